"""The prefill worker's half of a KV transfer, owned in one place: connect -> load a stored
prefix -> admit -> begin -> layers -> finish or abort -> outcome -> release.

``KVSender.send`` computes a prompt while its KV streams, layer by layer, into the blocks a
decode worker reserved, and returns once the bytes are confirmed there. A prompt longer than
one pass's budget is computed in chunks and streams during its last one. Cancelling the
send (the caller went away) drops the prompt before its next chunk and aborts the job.
Whatever happens, the request's local blocks are released (kept in the prefix cache) only
once the transfer's outcome is in: the writer reads them until then.

The fence, the writer's half: a failed send raises ``SendFailed``, whose ``fenced`` says that
no byte of the request can land in the destination any more (the writer never began, or
its abort came back with the job quiet: ``TransferJob.quiet``). Only then may the decode
worker reuse the blocks at once; otherwise it waits out its KV lease.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, PrefillOutput
from engine.sampling_params import SamplingParams
from kvstore.prefix import PrefixLoad, loaded_prefix
from services.common import metrics
from services.common.background import Background
from services.common.kv_store import StoreLink
from services.common.worker_messages import KVDestination
from transfer.base import KVSource, TransferJob, TransferResult, Transport
from transfer.errors import TransferError
from transfer.handle import KVLayout

log = structlog.get_logger(__name__)

ROLE = "prefill"

# How long past its deadline a transfer's outcome may come (the writer fails the job at the
# deadline, and a failed job drains for at most transfer.writer.DRAIN_TIMEOUT_S); later, the
# writer is taken for stuck.
OUTCOME_GRACE_S = 5.0


@dataclass(frozen=True)
class Sent:
    """A prompt computed and its KV confirmed at the destination."""

    output: PrefillOutput
    loaded: PrefixLoad  # blocks loaded from the KV store (part of output.num_cached_tokens)
    transfer: TransferResult
    num_tokens: int  # prompt + resumed tokens planned
    queue_seconds: float  # arrival -> the transfer began (planning included)
    compute_seconds: float  # the forward pass, batched with others
    tail_seconds: float  # last layer computed -> bytes confirmed


class SendFailed(Exception):
    """A send that did not deliver: ``cause`` is why; ``fenced``: no byte of it can land in
    the destination any more."""

    def __init__(self, cause: BaseException, *, fenced: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.fenced = fenced


class KVSender:
    """Sends prompts' KV from this worker's pool through ``transports`` (by name)."""

    def __init__(
        self,
        aengine: AsyncEngine,
        transports: dict[str, Transport],
        store: StoreLink | None = None,
    ) -> None:
        """``store``: the KV store a prompt's prefix is loaded from before it is planned."""
        self.aengine = aengine
        self.transports = transports
        self.store = store
        eng = aengine.engine
        # A GPU engine's pool is staged into a host pool of the same layout (kv_host) for
        # the transports that send from host memory; cuda_ipc copies from the pool itself.
        layout = KVLayout.from_spec(eng.kv_spec)
        self._sources = {
            on_device: KVSource((eng.kv if on_device else eng.kv_host).as_bytes(), layout)
            for on_device in {t.source_on_device for t in transports.values()}
        }
        self._releases = Background()
        # Engine keys are per call: a request placed again (a migration, a retry) may reach
        # this worker while its earlier attempt's blocks are still held for a transfer.
        self._calls = itertools.count()

    def transport(self, name: str) -> Transport:
        """The transport ``name``; ``InvalidRequestError`` if this worker has none such."""
        transport = self.transports.get(name)
        if transport is None:
            raise InvalidRequestError(
                f"transport {name!r} is not served here (have {sorted(self.transports)})"
            )
        return transport

    async def send(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        resumed: Sequence[int],
        params: SamplingParams,
        dest: KVDestination,
        *,
        arrival: float,
        deadline: float,
    ) -> Sent:
        """Compute the prompt (+ ``resumed`` tokens) and deliver its KV to ``dest`` by
        ``deadline`` (``time.monotonic()``); ``SendFailed`` otherwise."""
        transport = self.transport(dest.region.transport)
        source = self._sources[transport.source_on_device]
        try:
            # Opening a path may dial the destination (a tcp connect): off the event loop,
            # so one unreachable decode worker cannot stall every other call here.
            writer = transport.open_writer(dest.region, source) or await asyncio.to_thread(
                transport.connect, dest.region, source
            )
        except TransferError as e:
            raise SendFailed(e, fenced=True) from e
        key = f"{request_id}#{next(self._calls)}"
        store = self.store.store if self.store is not None else None
        loading = self.store.loading() if self.store is not None else {"timeout_s": 1.0}
        try:
            ids = [*prompt_ids, *resumed]
            async with loaded_prefix(self.aengine, store, ids, **loading) as loaded:
                admitted = await self.aengine.admit_prompt(key, prompt_ids, params, resumed)
        except Exception as e:
            raise SendFailed(e, fenced=True) from e
        job: TransferJob | None = None
        try:
            sent_ids = admitted.block_ids[dest.present_blocks :]
            job = writer.begin(
                request_id, sent_ids, dest.block_ids[dest.present_blocks :], deadline=deadline
            )
            started = time.monotonic()
            # Observed as the prompt starts (before its compute), as a queue time is.
            metrics.QUEUE_TIME.labels(ROLE).observe(started - arrival)
            hook = _layer_writer(self.aengine.engine, job, sent_ids, transport)
            # Counted as each pass computes them: a prompt abandoned between chunks counts
            # what it cost.
            count = metrics.PROMPT_TOKENS_COMPUTED.labels(ROLE).inc
            running = self.aengine.run_prefill(admitted, hook, count)
            out = await asyncio.wait_for(running, deadline - started)
            computed = time.monotonic()
            job.finish()
            result = await _outcome(job)
        except asyncio.CancelledError:
            # The caller went away (the decode worker cancelled the call): the prompt was
            # dropped before its next chunk; the writer stops, then the blocks are released.
            if job is not None:
                job.abort("cancelled: the caller went away")
            raise
        except Exception as e:
            fenced = True
            if job is not None:
                job.abort(f"failed: {type(e).__name__}")
                fenced = await _stopped(job) and job.quiet
            raise SendFailed(e, fenced=fenced) from e
        finally:
            # The reply need not wait for the release (a command to the engine thread,
            # which may be computing another prompt).
            self._releases.spawn(self._release_when_stopped(key, job))
        return Sent(
            output=out,
            loaded=loaded,
            transfer=result,
            num_tokens=admitted.num_tokens,
            queue_seconds=started - arrival,
            compute_seconds=computed - started,
            tail_seconds=time.monotonic() - computed,
        )

    async def _release_when_stopped(self, key: str, job: TransferJob | None) -> None:
        """Release the request's local blocks once no transfer reads them any more."""
        if job is not None and not await _stopped(job):
            # The writer never reported back: its blocks are leaked, not reused under a
            # copy that may still run.
            log.error("transfer_outcome_lost", request_id=key)
            return
        await self.aengine.release(key)


def _layer_writer(
    engine: LLMEngine, job: TransferJob, block_ids: tuple[int, ...], transport: Transport
) -> Callable[[int], None]:
    """The engine-thread hook that hands each computed layer to the transfer: staged to the
    host pool first when the engine's pool is elsewhere (a GPU's), unless the transport
    reads that pool itself (then only ordered after the layer's KV store)."""

    def on_layer_kv(layer: int) -> None:
        if transport.source_on_device:
            job.write_layer(layer, engine.layer_written(layer))
        else:
            job.write_layer(layer, engine.stage_layer(layer, block_ids))

    return on_layer_kv


async def _stopped(job: TransferJob) -> bool:
    """Whether a job's writer reported its outcome (success or failure) by the deadline plus
    grace: it no longer touches the source or the destination."""
    try:
        await _outcome(job)
    except TransferError:
        return True
    except TimeoutError:
        return False
    return True


async def _outcome(job: TransferJob) -> TransferResult:
    """A transfer's outcome; ``TimeoutError`` if the writer did not report by the job's
    deadline plus ``OUTCOME_GRACE_S``."""
    left = max(0.0, job.deadline - time.monotonic()) + OUTCOME_GRACE_S
    return await asyncio.wait_for(asyncio.wrap_future(job.outcome), left)

"""An ``LLMEngine`` driven by its own thread, for asyncio services.

The engine is not thread-safe and its steps block for tens of milliseconds, so it gets one
thread that alone touches it (one owner of the state). Coroutines talk to it through a
command queue; results come back as futures and per-request asyncio queues.

Loop (the engine thread): receive commands -> one pass over queued prefill-only prompts
(prefill role: at most ``prefill_token_budget`` tokens, a longer prompt computed in chunks
over several passes, so that a cancelled one stops at the next pass) -> one ``step()`` of
continuous batching (colocated and decode roles) ->
hand each event to its request's asyncio queue -> wait (bounded by ``delivery_wait_s``)
until the event loop has run the consumers those events woke. Idle, it blocks on the
command queue.

Why the wait: the next step's compute would otherwise race the event loop for the GIL and,
when the worker has one core, for the core itself, and a token produced now would reach the
socket only when the scheduler or the 5 ms GIL interval lets the loop in. Handing the loop
the turn first costs the step the time to send its tokens (what it would pay anyway on
one core) and takes that tail off every token's delivery.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import structlog

from engine.errors import InvalidRequestError
from engine.llm_engine import AdmittedPrompt, LLMEngine, PrefillOutput, Reservation
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from engine.step_budget import StepBudget
from engine.threads import core_set, name_current_thread, pin_current_thread
from engine.top_logprobs import TopLogprobs

log = structlog.get_logger(__name__)

_IDLE_WAIT_S = 0.05
_START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for heartbeats and metrics (read on the engine thread)."""

    running: int
    waiting: int
    held: int
    free_blocks: int
    total_blocks: int
    num_preemptions: int
    queued_prefill_tokens: int
    target_batch: int = 0  # the running batch's cap now (``LLMEngine.batch_cap``)
    itl_target_s: float = 0.0  # the ITL target it keeps to (0: none, throughput mode)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass
class _PrefillJob:
    prompt: AdmittedPrompt
    on_layer_kv: Callable[[int], None] | None
    on_computed: Callable[[int], None] | None
    future: Future[PrefillOutput]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        prefill_token_budget: int = 4096,
        delivery_wait_s: float = 0.0,
        cpus: frozenset[int] | set[int] | None = None,
    ) -> None:
        """``delivery_wait_s``: the bound on the wait after each step (0: none; a service
        passes its tuning's). ``cpus``: the cores the engine thread (and the torch threads
        it starts) runs on; None: wherever the process may run. ``ValueError`` unless a
        non-empty set of core numbers; cores the system refuses fail ``start``."""
        if delivery_wait_s < 0:
            raise ValueError(f"delivery_wait_s must be >= 0, got {delivery_wait_s}")
        self.cpus = core_set(cpus) if cpus is not None else None
        self.engine = engine
        self.prefill_token_budget = prefill_token_budget
        self.delivery_wait_s = delivery_wait_s
        self.num_delivery_waits = 0  # steps whose wait ran out before the loop had its turn
        # ``on_step(kind, seconds, size)`` runs on the engine thread after every unit of
        # work: kind "step" (one continuous-batching step; size: events it produced) or
        # "prefill" (a batch of prefill-only prompts; size: prompts). For metrics: it must
        # be quick, and what it raises is logged, never propagated.
        self.on_step: Callable[[str, float, int], None] | None = None
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._prefills: list[_PrefillJob] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = self._snapshot()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; raises ``OSError`` (and starts nothing) when it cannot
        run on ``cpus``."""
        self._loop = asyncio.get_running_loop()
        placed: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(placed,), name="engine", daemon=True
        )
        self._thread.start()
        try:
            placed.result(timeout=_START_TIMEOUT_S)
        except BaseException:
            self._stop.set()
            self._thread.join(_START_TIMEOUT_S)
            raise

    async def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def native_thread_id(self) -> int | None:
        """The engine thread's OS id once started (``/proc/<pid>/task/<id>``)."""
        return self._thread.native_id if self._thread is not None else None

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_active(self) -> int:
        return len(self._streams) + len(self._prefills)

    # -- calls (coroutines) -------------------------------------------------------------
    async def calibrate(self) -> StepBudget:
        """Time the engine's decode steps on its thread (``LLMEngine.calibrate``) and log
        the budget: call once started, before serving."""
        budget: StepBudget = await self.call(self.engine.calibrate)
        self._stats = await self.call(self._snapshot)
        model = budget.model
        log.info(
            "step_budget",
            quiet_step_ms=None if budget.quiet_step_s is None else budget.quiet_step_s * 1000,
            per_seq_ms=None if model is None else model.per_seq_s * 1000,
            itl_target_ms=(budget.target_s or 0.0) * 1000,
            target_batch=budget.cap,
        )
        return budget

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn`` for the engine thread now (commands run in order); its result later."""
        fut: Future[Any] = Future()
        self._commands.put((fn, fut))
        return fut

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        resumed: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Colocated: queue a request and stream its events; cancelling aborts it.
        ``resumed``: a migrated request's output tokens so far (events carry only new ones)."""
        q = self._open(request_id)
        try:
            await self.call(lambda: self.engine.add_request(prompt, params, request_id, resumed))
        except BaseException as e:
            self._forget(request_id, cancelled=isinstance(e, asyncio.CancelledError))
            raise
        async for ev in self._drain(request_id, q):
            yield ev

    async def reserve(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        resumed: Sequence[int] = (),
    ) -> Reservation:
        """Decode role: allocate blocks for a prompt (and a migrated request's resumed
        output tokens) that a prefill worker will fill, this pool's cached prefix reused
        (``LLMEngine.reserve``)."""
        try:
            return await self.call(
                lambda: self.engine.reserve(request_id, prompt_ids, params, resumed)
            )
        except asyncio.CancelledError:
            # The engine thread may have reserved anyway: nobody would release it.
            self.submit(lambda: self.engine.release(request_id))
            raise

    def fence(self, request_id: str, tag: str) -> Future[str]:
        """Decode role: set a reservation aside (blocks held, id free again), queued at once,
        ahead of any later command; ``release`` the key it resolves to once the blocks'
        writer is known to have stopped."""
        return self.submit(lambda: self.engine.fence(request_id, tag))

    async def join_prefilled(
        self,
        request_id: str,
        first_token: int,
        first_logprob: float,
        *,
        num_cached_tokens: int = 0,
        first_top_logprobs: TopLogprobs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Decode role: the reserved blocks hold the prompt's KV; stream the generation.
        ``num_cached_tokens``, ``first_top_logprobs``: as ``LLMEngine.add_prefilled``."""
        q = self._open(request_id)

        def add() -> None:
            ev = self.engine.add_prefilled(
                request_id,
                first_token,
                first_logprob,
                num_cached_tokens=num_cached_tokens,
                first_top_logprobs=first_top_logprobs,
            )
            self._deliver(ev)

        try:
            await self.call(add)
        except BaseException as e:
            self._forget(request_id, cancelled=isinstance(e, asyncio.CancelledError))
            raise
        async for ev in self._drain(request_id, q):
            yield ev

    async def admit_prompt(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        resumed: Sequence[int] = (),
    ) -> AdmittedPrompt:
        """Prefill role: validate a prompt and hold its blocks (a cached prefix reused).

        Then ``run_prefill``, and ``release`` once the KV has been sent (also after a
        failure or a cancellation: the blocks stay held until then).
        """
        try:
            return await self.call(
                lambda: self.engine.admit_prompt(request_id, prompt_ids, params, resumed)
            )
        except asyncio.CancelledError:
            # The engine thread may have planned it anyway: nobody would release it.
            self.submit(lambda: self.engine.release(request_id))
            raise

    async def run_prefill(
        self,
        prompt: AdmittedPrompt,
        on_layer_kv: Callable[[int], None] | None = None,
        on_computed: Callable[[int], None] | None = None,
    ) -> PrefillOutput:
        """Prefill role: compute a planned prompt (batched with others queued close
        together; beyond ``prefill_token_budget`` tokens, chunk by chunk) and sample its
        first token.

        Both hooks run on the engine thread: ``on_layer_kv(layer)`` as each layer's KV of
        the whole prompt lands (during its last chunk's pass, the earlier chunks' KV being
        in the pool by then), ``on_computed(tokens)`` after each pass that computed some of
        it. Cancelling drops the prompt before its next pass (a pass under way ends first);
        its blocks stay held until ``release``.
        """
        fut: Future[PrefillOutput] = Future()
        job = _PrefillJob(prompt, on_layer_kv, on_computed, fut)
        try:
            await self.call(lambda: self._prefills.append(job))
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # queued after the append: it runs before the batch
            self._commands.put((lambda: self._drop_queued(prompt.request_id), Future()))
            raise

    def _drop_queued(self, request_id: str) -> None:
        for job in [j for j in self._prefills if j.prompt.request_id == request_id]:
            self._prefills.remove(job)
            job.future.cancel()

    async def release(self, request_id: str) -> bool:
        """Free a admitted prompt's blocks (kept in the prefix cache) or a reservation; a
        prompt of it still queued is dropped first."""

        def release() -> bool:
            self._drop_queued(request_id)
            return self.engine.release(request_id)

        return await self.call(release)

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda: self.engine.abort_request(request_id))

    def _forget(self, request_id: str, *, cancelled: bool) -> None:
        """Drop a stream whose start failed. If the caller was cancelled, the engine thread
        may still have added the request: queue an abort so it does not run unread."""
        self._streams.pop(request_id, None)
        if cancelled:
            self._commands.put((lambda: self.engine.abort_request(request_id), Future()))

    # -- streams ------------------------------------------------------------------------
    def _open(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    async def _drain(
        self, request_id: str, q: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away: free the blocks
                self._commands.put((lambda: self.engine.abort_request(request_id), Future()))

    def _deliver(self, ev: RequestOutput) -> None:
        q = self._streams.get(ev.request_id)
        if q is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, ev)

    # -- the engine thread --------------------------------------------------------------
    def _run(self, placed: Future[None]) -> None:
        name_current_thread("pdserve-engine")
        # Before any torch work here: the intra-op threads this thread starts inherit it.
        if self.cpus is not None:
            try:
                pin_current_thread(self.cpus)
            except OSError as e:
                placed.set_exception(
                    OSError(e.errno, f"cannot run the engine thread on cores {sorted(self.cpus)}")
                )
                return
        placed.set_result(None)
        eng = self.engine
        while not self._stop.is_set():
            busy = eng.has_unfinished() or bool(self._prefills)
            self._run_commands(block=not busy)
            try:
                if self._prefills:
                    self._run_prefills()
                if eng.has_unfinished():
                    t0 = time.perf_counter()
                    events = eng.step()
                    self._report("step", time.perf_counter() - t0, len(events))
                    for ev in events:
                        self._deliver(ev)
                    if events:
                        self._await_consumers()
            except Exception as e:  # an engine bug must not kill the thread silently
                log.exception("engine_step_failed")
                self._fail_all(e)
            self._stats = self._snapshot()

    def _report(self, kind: str, seconds: float, size: int) -> None:
        hook = self.on_step
        if hook is None:
            return
        try:
            hook(kind, seconds, size)
        except Exception:  # a metrics hook must never stop the engine
            log.exception("on_step_failed")

    def _await_consumers(self) -> None:
        """Block (at most ``delivery_wait_s``) until the event loop has run the coroutines
        this step's events woke: two loop iterations after the deliveries were queued."""
        loop = self._loop
        if self.delivery_wait_s <= 0 or loop is None:
            return
        turn = threading.Event()

        def second_iteration() -> None:
            loop.call_soon(turn.set)

        loop.call_soon_threadsafe(loop.call_soon, second_iteration)
        if not turn.wait(self.delivery_wait_s):
            self.num_delivery_waits += 1

    def _run_commands(self, *, block: bool) -> None:
        try:
            fn, fut = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_prefills(self) -> None:
        """One pass: queued prompts in order, each taking what the budget has left (the
        first may be a chunk of a longer prompt, the last the first chunk of one)."""
        batch: list[tuple[_PrefillJob, int, bool]] = []  # job, tokens, completes the prompt
        room = self.prefill_token_budget
        for job in self._prefills:
            if room <= 0:
                break
            pending = self.engine.prefill_pending(job.prompt.request_id)
            n = min(pending, room)
            batch.append((job, n, n == pending))
            room -= n
        hooks = [j.on_layer_kv for j, _, last in batch if last and j.on_layer_kv is not None]

        def on_layer(layer: int) -> None:
            for hook in hooks:
                hook(layer)

        t0 = time.perf_counter()
        try:
            outs = self.engine.run_prefill(
                [j.prompt for j, _, _ in batch],
                on_layer if hooks else None,
                max_tokens=[n for _, n, _ in batch],
            )
        except Exception as e:  # the blocks stay held: their owners release them
            for j, _, _ in batch:
                self._prefills.remove(j)
                j.future.set_exception(e)
            return
        seconds = time.perf_counter() - t0
        log.debug("prefill_batch", size=len(batch), tokens=self.prefill_token_budget - room)
        self._report("prefill", seconds, len(batch))
        by_id = {out.request_id: out for out in outs}
        for j, n, _ in batch:
            if j.on_computed is not None:
                try:
                    j.on_computed(n)
                except Exception:  # a counter's hook must never stop the engine
                    log.exception("on_computed_failed")
            out = by_id.get(j.prompt.request_id)
            if out is not None:
                self._prefills.remove(j)
                j.future.set_result(out)

    def _fail_all(self, e: Exception) -> None:
        for rid in list(self._streams):
            q = self._streams.get(rid)
            if q is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(q.put_nowait, e)
            self.engine.abort_request(rid)

    def _snapshot(self) -> EngineStats:
        eng = self.engine
        sched = eng.scheduler
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            held=eng.num_held,
            free_blocks=eng.blocks.num_free_blocks,
            total_blocks=eng.blocks.num_blocks,
            num_preemptions=eng.num_preemptions,
            # Prompt tokens accepted and not computed yet: queued prefill-only prompts, and
            # the prompts waiting in the batch scheduler (a local prefill).
            queued_prefill_tokens=sum(
                eng.prefill_pending(j.prompt.request_id) for j in self._prefills
            )
            + sum(seq.pending for seq in sched.waiting),
            target_batch=eng.batch_cap,
            itl_target_s=eng.itl_target_s,
        )

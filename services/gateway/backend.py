"""What the gateway needs from whatever generates tokens: the ``Backend`` protocol.

The gateway validates, templates and tokenizes; a backend only runs a ready request and
streams its tokens back. Two implementations share this contract: ``EngineBackend`` (the
colocated engine in this process) and the disaggregated one (scheduler ``Place`` then decode
``Generate``).

Errors a backend raises (before or during the stream) are ``engine.errors`` classes, so
each edge maps them once: ``InvalidRequestError`` and ``CapacityError`` are the caller's
fault (HTTP 400 / INVALID_ARGUMENT), ``ResourceExhaustedError`` is overload (429 /
RESOURCE_EXHAUSTED), ``BackendUnavailableError`` means no worker can take it (503 /
UNAVAILABLE). Anything else is a server fault.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from engine.errors import EngineError
from engine.sampling_params import SamplingParams
from engine.top_logprobs import TopLogprobs


class BackendUnavailableError(EngineError):
    """No worker can serve the request now (none healthy, or shutting down); retry later."""


@dataclass(frozen=True)
class GenerateInput:
    """A validated, tokenized request, ready to run.

    ``prompt_token_ids`` is exactly what the model sees (template and BOS already applied);
    ``params`` has passed ``SamplingParams.check_against`` for the served model.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    model: str


@dataclass(frozen=True)
class ServedBy:
    """Which workers served a request and the KV it moved: the last chunk's ``served_by``.

    ``prefill_worker_id``: the prefill worker that computed the prompt (empty when the decode
    worker prefilled it itself, or with an in-process engine). ``decode_worker_id``: the
    worker that generated the tokens (empty with an in-process engine). ``kv_transfer_bytes``:
    KV bytes the prefill worker wrote into the decode worker for this request (0 for a local
    prefill). After a migration, all three describe the attempt that finished.
    """

    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    kv_transfer_bytes: int = 0


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed step of a generation.

    ``token_ids`` and ``logprobs`` are the tokens produced since the previous chunk (logprobs
    parallel to them, empty unless ``params.logprobs``); ``text_delta`` is their text, which
    may lag behind them (a split UTF-8 character or a possible stop string is held back).
    ``finish_reason`` ("stop", "length", "abort" or "error") is set on the last chunk only.
    The token counts are running totals for the request. ``produced_unix_ns``: when the
    tokens left the engine's process (the decode worker's stamp, or when an in-process
    engine handed them over); wall clock, for measuring the serving path's delay.
    ``served_by``: set on the last chunk by backends that know it (``ServedBy()`` otherwise).
    ``top_logprobs``: one per token when ``params.top_logprobs`` > 0 (each step's most
    likely tokens), empty otherwise.
    """

    text_delta: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    produced_unix_ns: int = 0
    served_by: ServedBy = ServedBy()
    top_logprobs: tuple[TopLogprobs, ...] = ()


class Backend(Protocol):
    """Runs requests the gateway has validated.

    ``generate`` is an async generator: it starts the request when first iterated and
    yields chunks until one carries a ``finish_reason``. Closing the iterator early
    (``aclose``, cancelling the task that iterates it, or dropping it) must cancel the
    request everywhere downstream and free its KV blocks. Errors that happen before the
    first chunk are raised from the first ``__anext__``.
    """

    on_target_batch: Callable[[int], None]
    """Told what the workers behind it run at once within their ITL targets, as it learns
    it (a placement's ``fleet_target_batch``, the local engine's batch target); the
    gateway's admission follows it."""

    def generate(self, req: GenerateInput) -> AsyncIterator[GenerateChunk]: ...

    async def ready(self) -> bool:
        """Whether a request sent now could be served (the health check's answer)."""
        ...

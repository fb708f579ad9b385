"""The worker RPCs' messages as typed values (``pdserve.v1.worker``: ``DecodeWorker.Generate``,
``PrefillWorker.Prefill``).

A worker's servicer turns protobuf into these at its edge (``services.common.convert``),
and its inner parts (``services/decode/kv_receiver.py``, ``services/prefill/kv_sender.py``)
see only them; the replies become protobuf again at the same edge. Field names follow
the protobuf fields they come from (the proto's comments are their contract).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.top_logprobs import TopLogprobs
from transfer.handle import MemoryRegionHandle


@dataclass(frozen=True)
class PrefillPlacement:
    """The prefill worker a decode worker has a request's prompt prefilled by, with what
    lets it write into this worker's KV region."""

    address: str  # its gRPC server's "host:port"
    worker_id: str  # for logs and outcomes
    placement_token: str  # the scheduler's, passed on in the Prefill call


@dataclass(frozen=True)
class GenerateRequest:
    """``DecodeGenerateRequest``: run one request to completion on a decode worker."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    resume_token_ids: tuple[int, ...] = ()  # a migrated request's tokens so far
    prefill: PrefillPlacement | None = None  # None: prefill here
    attempt: int = 0  # which placement of the request this is
    # > 0: prefill here only if at most this many tokens remain uncached (cache, store);
    # else with ``prefill`` (the scheduler's fallback)
    local_prefill_max_tokens: int = 0


@dataclass(frozen=True)
class KVDestination:
    """Where a request's KV goes: a decode worker's region and the blocks it reserved there,
    the leading ``num_present_tokens`` of which already hold their KV (they are not
    written)."""

    region: MemoryRegionHandle
    block_ids: tuple[int, ...]
    num_present_tokens: int = 0

    @property
    def present_blocks(self) -> int:
        """The leading blocks not written."""
        return self.num_present_tokens // self.region.layout.block_size


@dataclass(frozen=True)
class PrefillRequest:
    """``PrefillRequest``: compute a prompt and write its KV into ``kv_destination``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    kv_destination: KVDestination
    deadline_s: float = 0.0  # from receipt; 0: none given (the worker's default)
    decode_worker_id: str = ""
    placement_token: str = ""
    attempt: int = 0
    resume_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillReply:
    """``PrefillReply``: the destination blocks hold the KV; the first token and what the
    prefill cost."""

    request_id: str
    first_token_id: int
    first_token_logprob: float = 0.0
    first_token_top_logprobs: TopLogprobs | None = None  # when the request asks for them
    num_cached_tokens: int = 0  # the prompt tokens the request did not compute
    num_computed_tokens: int = 0
    kv_transfer_bytes: int = 0
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0
    transfer_seconds: float = 0.0
    transfer_tail_seconds: float = 0.0

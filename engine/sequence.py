"""One request's state inside an engine: tokens, KV blocks, progress. Owned by the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import Matcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling in chunks or decoding
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    """Mutable per-request state.

    Invariant: ``num_computed <= num_tokens``; the KV of ``all_ids[:num_computed]`` is in
    the blocks of ``block_table``. A step computes the next ``pending`` tokens; when it
    reaches ``num_tokens`` the model's next token is sampled. Preemption drops all KV
    (``num_computed = 0``) and the prompt plus the tokens generated so far are recomputed.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    generator: torch.Generator | None = None
    grammar: Matcher | None = None  # a structured output's place in its grammar
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_exported_blocks: int = 0  # leading full blocks told to LLMEngine.kv_export
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

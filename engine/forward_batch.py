"""What one forward pass computes: a flat list of new tokens plus where their KV lives.

Tokens of all sequences in a step are concatenated (prefill chunks first, then one token
per decoding sequence), so every linear layer runs once over the whole batch. Attention is
the only part that needs to know which token belongs to which sequence: that is what the
segments below describe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSegment:
    """A run of prompt tokens of one sequence, attending to its earlier (cached) context.

    ``start``/``length`` index the flat token array; ``context_len`` tokens precede this chunk
    (a reused prefix, or earlier chunks); ``block_table`` covers context + chunk.
    """

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor  # int64 [num_blocks]


@dataclass(frozen=True)
class DecodeBatch:
    """One new token per sequence for ``num_seqs`` sequences, at the tail of the flat array."""

    start: int
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with 0
    context_lens: torch.Tensor  # int64 [num_seqs], including the new token
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_blocks: torch.Tensor  # int64 [T]: block id where each new token's KV goes
    slot_offsets: torch.Tensor  # int64 [T]: offset inside that block
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeBatch | None
    logits_indices: torch.Tensor  # int64 [S]: rows of the flat array whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

"""What one forward pass computes: a flat list of new tokens plus where their KV lives.

Tokens of all sequences in a step are concatenated (prefill chunks first, then one token
per decoding sequence), so every linear layer runs once over the whole batch. Attention is
the only part that needs to know which token belongs to which sequence: that is what the
segments below describe.
"""

from __future__ import annotations

import dataclasses
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

    def to(self, device: torch.device) -> PrefillSegment:
        return dataclasses.replace(self, block_table=self.block_table.to(device, non_blocking=True))


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

    def to(self, device: torch.device) -> DecodeBatch:
        return dataclasses.replace(
            self,
            block_tables=self.block_tables.to(device, non_blocking=True),
            context_lens=self.context_lens.to(device, non_blocking=True),
        )


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

    def as_decode_rows(self) -> DecodeBatch:
        """Every row of the batch as a decode row: a prefill chunk's row ``i`` is one query
        over its sequence's first ``context_len + i + 1`` tokens (the chunk's keys and values
        are in the pool before attention runs). Attention computed this way gives a token the
        same numbers whether it came in a prompt, a chunk of one or a decode step: the
        batch-invariant mode's attention."""
        tables: list[torch.Tensor] = []
        lens: list[torch.Tensor] = []
        for seg in self.prefills:
            tables.append(seg.block_table.unsqueeze(0).expand(seg.length, -1))
            lens.append(torch.arange(seg.context_len + 1, seg.context_len + seg.length + 1))
        if self.decode is not None:
            tables.append(self.decode.block_tables)
            lens.append(self.decode.context_lens)
        width = max(t.shape[1] for t in tables)
        table = torch.zeros((self.num_tokens, width), dtype=torch.int64)
        row = 0
        for t in tables:
            table[row : row + t.shape[0], : t.shape[1]] = t
            row += t.shape[0]
        context_lens = torch.cat(lens)
        return DecodeBatch(0, table, context_lens, int(context_lens.max()))

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch on ``device`` (itself when already there). The engine builds
        batches on the host and uploads each once per step, so every index check runs on
        host memory and no kernel has to sync with the device to make it."""
        if self.input_ids.device == device:
            return self
        return ForwardBatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            slot_blocks=self.slot_blocks.to(device, non_blocking=True),
            slot_offsets=self.slot_offsets.to(device, non_blocking=True),
            prefills=tuple(seg.to(device) for seg in self.prefills),
            decode=None if self.decode is None else self.decode.to(device),
            logits_indices=self.logits_indices.to(device, non_blocking=True),
        )

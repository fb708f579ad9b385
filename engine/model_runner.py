"""Turns a scheduler step into one forward pass and one sampling call.

Owns the model, the KV pool and the sampler. Builds the flat ``ForwardBatch`` (prefill
chunks first, then every one-token sequence as a single decode batch), runs it, and samples
a token for each sequence whose step reached its end.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine import grammar, penalties
from engine.forward_batch import DecodeBatch, ForwardBatch, PrefillSegment
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.scheduler import ScheduledSeq
from engine.top_logprobs import TopLogprobs, top_logprobs


@dataclass(frozen=True)
class SampledToken:
    item: ScheduledSeq
    token_id: int
    logprob: float
    top: TopLogprobs | None = None  # when the request asks for top_logprobs


def build_forward_batch(items: Seq[ScheduledSeq], block_size: int) -> ForwardBatch:
    """Lay out the step's tokens; pure function of the scheduled sequences."""
    prefills = [it for it in items if not _is_decode(it)]
    decodes = [it for it in items if _is_decode(it)]
    ids: list[int] = []
    pos: list[int] = []
    blocks: list[int] = []
    offs: list[int] = []
    logits_idx: list[int] = []
    segments: list[PrefillSegment] = []
    for it in prefills:
        seq, start = it.seq, len(ids)
        first = seq.num_computed
        end = first + it.num_tokens
        for p in range(first, end):
            ids.append(seq.token_at(p))
            pos.append(p)
            blocks.append(seq.block_table[p // block_size])
            offs.append(p % block_size)
        nblk = -(-end // block_size)
        segments.append(
            PrefillSegment(
                start=start,
                length=it.num_tokens,
                context_len=first,
                block_table=torch.tensor(seq.block_table[:nblk], dtype=torch.int64),
            )
        )
        if it.samples:
            logits_idx.append(len(ids) - 1)
    decode: DecodeBatch | None = None
    if decodes:
        start = len(ids)
        lens = [it.seq.num_computed + 1 for it in decodes]
        max_len = max(lens)
        max_blocks = -(-max_len // block_size)
        table = torch.zeros((len(decodes), max_blocks), dtype=torch.int64)
        for r, it in enumerate(decodes):
            seq = it.seq
            p = seq.num_computed
            ids.append(seq.token_at(p))
            pos.append(p)
            blocks.append(seq.block_table[p // block_size])
            offs.append(p % block_size)
            nb = -(-(p + 1) // block_size)
            table[r, :nb] = torch.tensor(seq.block_table[:nb], dtype=torch.int64)
            logits_idx.append(len(ids) - 1)
        decode = DecodeBatch(
            start=start,
            block_tables=table,
            context_lens=torch.tensor(lens, dtype=torch.int64),
            max_context_len=max_len,
        )
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        slot_blocks=torch.tensor(blocks, dtype=torch.int64),
        slot_offsets=torch.tensor(offs, dtype=torch.int64),
        prefills=tuple(segments),
        decode=decode,
        logits_indices=torch.tensor(logits_idx, dtype=torch.int64),
    )


def ordered(items: Seq[ScheduledSeq]) -> list[ScheduledSeq]:
    """The order of rows in the forward batch (and hence of sampled tokens)."""
    return [it for it in items if not _is_decode(it)] + [it for it in items if _is_decode(it)]


def _is_decode(it: ScheduledSeq) -> bool:
    return it.num_tokens == 1 and it.seq.num_computed > 0


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, eos_token_ids: Collection[int] = ()) -> None:
        self.model = model
        self.kv = kv
        self.sampler = Sampler()
        self.block_size = kv.spec.block_size
        self.eos_token_ids = frozenset(eos_token_ids)  # what min_tokens bars

    def execute(
        self, items: Seq[ScheduledSeq], on_layer_kv: Callable[[int], None] | None = None
    ) -> list[SampledToken]:
        if not items:
            return []
        rows = ordered(items)
        batch = build_forward_batch(rows, self.block_size)
        hidden = self.model.forward(batch, self.kv, on_layer_kv)
        sampling = [it for it in rows if it.samples]
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden)
        seqs = [it.seq for it in sampling]
        # A grammar masks what the penalties left, so a constrained token is still the
        # penalised distribution's pick among the allowed ones.
        changed = grammar.mask(penalties.apply(logits, seqs, self.eos_token_ids), seqs)
        params = [it.seq.params for it in sampling]
        out = self.sampler(
            changed,
            params,
            [it.seq.generator for it in sampling],
            raw_logits=logits,
        )
        # The step's one read of the device (a second only for rows asking for top logprobs):
        # ids and logprobs in one copy (float64 holds every id and float32 logprob exactly).
        both = torch.stack((out.token_ids.double(), out.logprobs.double())).tolist()
        toks = [int(t) for t in both[0]]
        lps = both[1]
        tops = top_logprobs(logits, params)
        return [
            SampledToken(it, t, lp, top)
            for it, t, lp, top in zip(sampling, toks, lps, tops, strict=True)
        ]

    @torch.inference_mode()
    def logits_for(self, items: Seq[ScheduledSeq]) -> torch.Tensor:
        """Forward one step and return the sampled rows' logits (tests and parity checks)."""
        rows = ordered(items)
        batch = build_forward_batch(rows, self.block_size)
        return self.model.compute_logits(self.model.forward(batch, self.kv))

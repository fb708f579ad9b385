"""The most likely tokens at a step and their log-probabilities, for requests that ask.

Taken under the model's raw distribution (``log_softmax`` of the logits before penalties,
bias, temperature or filters), the same one the sampled token's own logprob is taken under,
so a sampled token listed here has its own logprob beside it. One ``topk`` covers every asking row;
rows that do not ask cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampler import log_normaliser
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TopLogprobs:
    """One step's most likely tokens, most likely first (ties in no set order), and their
    log-probabilities (natural log), parallel."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


def top_logprobs(
    raw_logits: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TopLogprobs | None]:
    """Row ``i``'s ``params[i].top_logprobs`` most likely tokens under ``raw_logits``
    (``[B, V]``), or None for a row that asks for none. One read of the device."""
    asks = [p.top_logprobs for p in params]
    rows = [row for row, k in enumerate(asks) if k]
    if not rows:
        return [None] * len(params)
    k_max = max(asks)
    index = torch.tensor(rows, device=raw_logits.device)
    logits = raw_logits.index_select(0, index).float()
    top = torch.topk(logits, min(k_max, logits.shape[1]), dim=-1, sorted=True)
    values = top.values - log_normaliser(logits).unsqueeze(1)
    # float64 holds every token id and float32 logprob exactly: one copy for both.
    ids, lps = torch.stack((top.indices.double(), values.double())).tolist()
    out: list[TopLogprobs | None] = [None] * len(params)
    for r, row in enumerate(rows):
        k = asks[row]
        out[row] = TopLogprobs(tuple(int(t) for t in ids[r][:k]), tuple(lps[r][:k]))
    return out

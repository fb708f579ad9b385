"""What a request asks to change in its logits before sampling: ``min_tokens``,
``logit_bias`` and the repetition, frequency and presence penalties, in that order
(``SamplingParams`` says what each does).

A row needs only its own tokens, the prompt and the output so far. A migrated request's
resumed tokens are its output, so the new worker applies the very changes the old one would
have: a penalised stream continues exactly where the logits do (batch-invariant mode).
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch

from engine.sequence import Sequence


def apply(logits: torch.Tensor, seqs: Seq[Sequence], eos_ids: Collection[int]) -> torch.Tensor:
    """``logits`` (``[B, V]``, one row per sequence of ``seqs``) with each row's changes
    made, from its parameters and its tokens so far; ``logits`` itself when no row asks for
    any. ``eos_ids``: what ``min_tokens`` bars besides the row's ``stop_token_ids`` (unless
    it ignores EOS)."""
    changed = [i for i, seq in enumerate(seqs) if seq.params.changes_logits]
    if not changed:
        return logits
    out = logits.clone()
    vocab = out.shape[1]
    for i in changed:
        p, logit = seqs[i].params, out[i]
        output = seqs[i].output_ids
        if len(output) < p.min_tokens:
            barred = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            logit[_ids(barred, logit.device)] = -torch.inf
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias, strict=True)
            logit[_ids(ids, logit.device)] += torch.tensor(bias, device=logit.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logit.device)
            seen[_ids(seqs[i].all_ids, logit.device)] = True
            x = logit[seen]
            logit[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(_ids(output, logit.device), minlength=vocab).to(logit.dtype)
            logit -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def _ids(ids: Collection[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64, device=device)

"""Turn one step's logits into one token per running sequence.

Sampling uses the exponential race: with ``E_i ~ Exp(1)`` drawn independently,
``argmax_i(p_i / E_i)`` is distributed exactly as ``p``. A sampled row draws its ``V`` uniforms
from its own ``torch.Generator`` every step whatever its settings, so a seeded request's tokens
depend only on its own logits and seed, never on which other requests share the batch.

Filters are expressed as "keep" rules on the temperature-scaled distribution ``p`` so that no
row needs a full sort:

* top-k keeps tokens with fewer than ``k`` strictly more probable tokens (ties at the k-th
  value are all kept);
* top-p keeps tokens whose strictly-more-probable mass, within the top-k survivors, is below
  ``top_p`` of those survivors' mass (the most probable token is always kept; ties at the
  boundary are all kept), which is the usual sorted-cumsum nucleus;
* min-p keeps tokens with ``p_i >= min_p * max(p)``.

Top-p is resolved lazily: the race winner over the top-k/min-p survivors is kept when it lies
in the nucleus, which happens with probability at least ``top_p``. Otherwise the nucleus lies
among the tokens heavier than that winner, so only those (of that row alone) are sorted to
find its edge, and the race reruns with the same noise. No ``[B, V]`` sort is ever needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams
from kernels import layer_ops

# rand() can return exactly 0; clamping keeps E = -log(u) finite so no surviving token's
# race score p / E can collapse to 0 (which could let a dropped token win a tie at 0).
_MIN_UNIFORM = 2.0**-30
# Floor for (x - max) / T. exp() and divisions that produce subnormal floats are very slow
# on CPU; exp(-80) / 20.8 (the largest E we draw) is still a normal float32.
_MIN_EXPONENT = -80.0


@dataclass(frozen=True)
class SamplerOutput:
    """One step's choice for each row of the batch.

    ``token_ids`` is ``[B]`` int64. ``logprobs`` is ``[B]`` float32: the chosen token's
    log-probability under the model's raw distribution (``log_softmax`` of the unprocessed
    logits, before temperature or filters).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor


class Sampler:
    """Batched sampler; stateless apart from the generator used by unseeded rows.

    ``default_generator`` drives rows whose generator is ``None``; when omitted, each device
    gets a freshly, non-deterministically seeded one on first use.
    """

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        self._default_generators: dict[torch.device, torch.Generator] = {}
        if default_generator is not None:
            self._default_generators[torch.device(default_generator.device)] = default_generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Pick one token per row of ``logits`` (``[B, V]`` float32).

        ``params[i]`` and ``generators[i]`` belong to row ``i``. Greedy rows take the argmax
        (lowest id on ties) and draw no random numbers; every other row draws exactly ``V``
        uniforms from ``generators[i]`` (or the shared default generator when ``None``).
        ``raw_logits``: the model's logits before penalties and biases (``engine.penalties``)
        made ``logits``; logprobs are taken under them (default: ``logits``).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"got {batch} logits rows, {len(params)} params and {len(generators)} generators"
            )
        logits = logits.float()
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        # Rows at temperature 1 get the raw softmax normaliser from the sampler's own weights
        # (unless penalties, a bias or a grammar changed those weights: their raw logits are
        # elsewhere).
        known_norm = [
            row
            for row in sampled
            if params[row].temperature == 1.0
            and (
                raw_logits is None
                or not (params[row].changes_logits or params[row].structured is not None)
            )
        ]
        if not sampled:
            token_ids = torch.argmax(logits, dim=-1)
            totals = None
        elif len(sampled) == batch:
            token_ids, totals = self._sample(logits, params, generators)
        else:
            greedy = [row for row, p in enumerate(params) if p.greedy]
            greedy = torch.tensor(greedy, device=logits.device)
            rows = torch.tensor(sampled, device=logits.device)
            token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
            token_ids[greedy] = torch.argmax(logits.index_select(0, greedy), dim=-1)
            token_ids[rows], sampled_totals = self._sample(
                logits.index_select(0, rows),
                [params[row] for row in sampled],
                [generators[row] for row in sampled],
            )
            totals = torch.ones(batch, dtype=torch.float32, device=logits.device)
            totals[rows] = sampled_totals
        raw = logits if raw_logits is None else raw_logits.float()
        return SamplerOutput(
            token_ids=token_ids, logprobs=_raw_logprobs(raw, token_ids, totals, known_norm)
        )

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Race-sample every row of ``logits``; all rows have temperature > 0.

        Returns the token ids and, per row, the sum of ``exp((x - max) / T)`` before any filter
        (at T = 1 that is the raw softmax normaliser, which spares a ``logsumexp``).
        """
        rows, vocab = logits.shape
        device = logits.device

        # weights = exp((x - max) / T): unnormalised p whose max is exactly 1, so min-p is a
        # plain threshold, and which cannot overflow however small T is.
        weights = logits - logits.amax(dim=-1, keepdim=True)
        if any(p.temperature != 1.0 for p in params):
            inv_t = torch.tensor([1.0 / p.temperature for p in params], device=device)
            weights.mul_(inv_t.unsqueeze(1))
        # A token at the floor weighs 1.8e-35 against the top token's 1: it cannot win the race
        # (that needs E < 1e-33, and the smallest E we draw is -log(1 - 2**-24) = 6e-8) and
        # adds under 1e-30 to any mass, so the clamp changes no outcome.
        weights.clamp_(min=_MIN_EXPONENT).exp_()
        totals = _row_sums(weights)

        # Per-row loops of F.threshold_ below: a [rows, V] bool mask (masked_fill/where) costs
        # far more on CPU than thresholding each row against its own scalar.
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(top_k):
            k_max = max(top_k)
            kth = torch.topk(weights, k_max, dim=-1, sorted=True).values
            index = torch.tensor([(k or k_max) - 1 for k in top_k], device=device)
            for row, bound in enumerate(_just_below(kth.gather(1, index.unsqueeze(1)))):
                if top_k[row]:
                    F.threshold_(weights[row], bound, 0.0)

        nucleus = [row for row, p in enumerate(params) if p.top_p < 1.0]
        if nucleus:
            # Top-p renormalises over the top-k survivors, so their mass is taken before min-p.
            # Summed row by row: a [rows, V] reduction may order the additions differently for
            # different batch shapes, and a seeded row's nucleus must not depend on the batch.
            mass = _row_sums(weights[nucleus]).tolist()
            limits = {row: params[row].top_p * m for row, m in zip(nucleus, mass, strict=True)}

        min_p = [p.min_p for p in params]
        if any(min_p):
            bounds = _just_below(torch.tensor(min_p, device=device))
            for row, bound in enumerate(bounds):
                if min_p[row] > 0.0:
                    F.threshold_(weights[row], bound, 0.0)

        exp_noise = self._uniforms(rows, vocab, device, generators)
        exp_noise.clamp_(min=_MIN_UNIFORM).log_().neg_()  # E = -log(u) ~ Exp(1)
        if not nucleus:
            token_ids = torch.argmax(torch.div(weights, exp_noise, out=exp_noise), dim=-1)
            return token_ids, totals
        token_ids = torch.argmax(torch.div(weights, exp_noise), dim=-1)
        _restrict_to_nucleus(token_ids, weights, exp_noise, limits)
        return token_ids, totals

    def _uniforms(
        self,
        rows: int,
        vocab: int,
        device: torch.device,
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        noise = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        if all(g is None for g in generators):
            noise.uniform_(generator=self._default_generator(device))
            return noise
        default = self._default_generator(device)
        for row, generator in enumerate(generators):
            noise[row].uniform_(generator=default if generator is None else generator)
        return noise

    def _default_generator(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        generator = self._default_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.seed()
            self._default_generators[device] = generator
        return generator


def _raw_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    totals: torch.Tensor | None,
    known_norm: list[int],
) -> torch.Tensor:
    """``log_softmax(logits)`` at ``token_ids``; rows in ``known_norm`` reuse ``totals``."""
    batch = logits.shape[0]
    chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if totals is None or not known_norm:
        return chosen - log_normaliser(logits)
    log_norm = totals.log_().add_(logits.amax(dim=-1))
    if len(known_norm) < batch:
        known = set(known_norm)
        rest = [row for row in range(batch) if row not in known]
        rest_index = torch.tensor(rest, device=logits.device)
        log_norm[rest_index] = log_normaliser(logits.index_select(0, rest_index))
    return chosen - log_norm


def log_normaliser(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` of each row, with ``exp``'s arguments floored at ``_MIN_EXPONENT``.

    The floor changes no float32 result (a floored term adds 1.8e-35 to a sum of at least 1)
    but keeps ``exp`` off its slow path below about -87: ``torch.logsumexp`` over logits
    spanning 240 nats took 0.68 ms per 49k-token row on this CPU against 0.05 ms here.
    (SmolLM2's logits span 20-40 nats, where both take ~0.05 ms; a confident model's span
    can be far wider.)"""
    top = logits.amax(dim=-1)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = _row_sums((logits - top.unsqueeze(1)).clamp_(min=_MIN_EXPONENT).exp_())
    return total.log_().add_(top)


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """The sum of each row of ``x`` (``[B, V]``). torch's ``sum(dim=-1)`` splits a lone
    row's reduction across threads but not a batch's rows, so a row's logprob (and top-p's
    mass) would change in the last bits with the batch and the thread count. The compiled
    op sums each row in one fixed order (on the CPU, where it is built); elsewhere torch's
    sum serves."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and layer_ops.layer_ops_available():
        return layer_ops.row_sums(x.contiguous())
    return x.sum(dim=-1)


def _just_below(values: torch.Tensor) -> list[float]:
    """The float32 just under each value, so ``F.threshold`` (which keeps ``x > bound``)
    keeps ``x >= value``."""
    values = values.flatten().float()
    return torch.nextafter(values, torch.full_like(values, -torch.inf)).tolist()


def _restrict_to_nucleus(
    token_ids: torch.Tensor,
    weights: torch.Tensor,
    exp_noise: torch.Tensor,
    limits: dict[int, float],
) -> None:
    """Make each ``limits`` row's winner the race winner over that row's nucleus.

    A token is in the nucleus when the mass of strictly heavier tokens is below the row's
    limit. The unrestricted winner is accepted with probability at least ``top_p``, so most
    rows need only that check. For the rest, find the nucleus's edge among the tokens heavier
    than the rejected winner, drop everything lighter from ``weights`` (in place) and rerun the
    race with the same noise.
    """
    rows = list(limits)
    index = torch.tensor(rows, device=weights.device)
    winners = weights[index, token_ids[index]].tolist()
    above_winner = [F.threshold(weights[row], w, 0.0) for row, w in zip(rows, winners, strict=True)]
    heavier = _row_sums(torch.stack(above_winner)).tolist()
    for row, winner, above in zip(rows, winners, heavier, strict=True):
        if above < limits[row]:
            continue
        # The nucleus lies among the tokens heavier than the rejected winner (their mass reaches
        # the limit), and those are usually few: sort just them.
        row_weights = weights[row]
        heaviest = torch.sort(row_weights[row_weights > winner], descending=True).values
        mass_before = torch.cumsum(heaviest, 0) - heaviest
        kept = max(int(torch.count_nonzero(mass_before < limits[row])), 1)
        F.threshold_(row_weights, _just_below(heaviest[kept - 1])[0], 0.0)
        token_ids[row] = torch.argmax(row_weights / exp_noise[row])


def skip_draws(generator: torch.Generator, vocab: int, steps: int = 1) -> None:
    """Advance a seeded row's generator past ``steps`` sampled tokens.

    A sequence's first token may be sampled on another worker (the prefill worker); the
    decode worker continues the same random stream by consuming exactly what ``Sampler``
    would have drawn for those tokens, so seeded output is the same disaggregated or not.
    """
    scratch = torch.empty(vocab, dtype=torch.float32, device=generator.device)
    for _ in range(steps):
        scratch.uniform_(generator=generator)

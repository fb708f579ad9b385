"""The batched sampler: greedy, filters, sampled distribution, per-request seeds, logprobs."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from engine.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams

VOCAB = 49152


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@functools.cache
def _cached_logits(batch: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=_gen(seed)) * 3.0


def _llm_like_logits(batch: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return _cached_logits(batch, seed, vocab).clone()


def _expected_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference: temperature, then top-k, then sorted-cumsum top-p, then min-p."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[order[params.top_k :]] = False
    kept_sorted = probs[order] * keep[order]
    kept_sorted = kept_sorted / kept_sorted.sum()
    exclusive_cumsum = torch.cumsum(kept_sorted, 0) - kept_sorted
    keep[order[exclusive_cumsum >= params.top_p]] = False
    keep &= probs >= params.min_p * probs.max()
    dist = probs * keep
    return dist / dist.sum()


def _draw(
    logits_row: torch.Tensor, params: SamplingParams, draws: int, *, seeded: bool
) -> torch.Tensor:
    """Sample ``draws`` times from one row by batching copies of it; return token counts."""
    sampler = Sampler(default_generator=_gen(1234))
    logits = logits_row.expand(draws, -1).contiguous()
    generators = [_gen(10_000 + i) for i in range(draws)] if seeded else [None] * draws
    out = sampler(logits, [params] * draws, generators)
    return torch.bincount(out.token_ids, minlength=logits_row.numel())


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    # On a 2-core machine shared with other test processes, OpenMP threads spin-waiting for a
    # busy core made this file ~10x slower. Restored after each test; one test uses two.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SMALL_LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.9, 0.5, 0.0, -0.4, -1.0, -1.7, -3.0])

DISTRIBUTION_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.12),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-generator", "per-row-generators"])
@pytest.mark.parametrize("params", DISTRIBUTION_CASES, ids=repr)
def test_sampled_distribution_matches_filtered_softmax(
    params: SamplingParams, seeded: bool
) -> None:
    draws = 4000
    expected = _expected_distribution(SMALL_LOGITS, params)
    counts = _draw(SMALL_LOGITS, params, draws, seeded=seeded).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "sampled a token the filters remove"
    observed, wanted = counts[kept], expected[kept] * draws
    chi_square = float(((observed - wanted) ** 2 / wanted).sum())
    dof = int(kept.sum()) - 1
    # ~99.99th percentile of chi-square for these degrees of freedom; the draws are seeded.
    assert chi_square < dof + 6.0 * (2.0 * dof) ** 0.5 + 6.0, (chi_square, observed, wanted)


def test_distribution_check_detects_a_wrong_temperature() -> None:
    # Guards the test above: samples at T=1 must fail the bound computed for T=0.6.
    counts = _draw(SMALL_LOGITS, SamplingParams(temperature=1.0), 4000, seeded=False).double()
    wanted = _expected_distribution(SMALL_LOGITS, SamplingParams(temperature=0.6)) * 4000
    chi_square = float(((counts - wanted) ** 2 / wanted).sum())
    assert chi_square > 9 + 6.0 * 18**0.5 + 6.0


def test_greedy_equals_argmax_with_lowest_id_on_ties() -> None:
    logits = _llm_like_logits(6, seed=0)
    logits[2, 17] = logits[2, 4000] = logits[2].max() + 1.0  # a tie: the lower id wins
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert torch.equal(out.token_ids, torch.argmax(logits, dim=-1))
    assert out.token_ids[2] == 17
    assert out.token_ids.dtype == torch.int64


def test_greedy_rows_draw_no_random_numbers() -> None:
    generator = _gen(3)
    before = generator.get_state()
    Sampler()(_llm_like_logits(2, seed=1), [SamplingParams(temperature=0.0)] * 2, [generator, None])
    assert torch.equal(generator.get_state(), before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(top_k=40, top_p=0.3, min_p=0.2, temperature=0.5),
        SamplingParams(top_p=0.95),
    ],
    ids=repr,
)
def test_sampled_row_draws_exactly_vocab_uniforms(params: SamplingParams) -> None:
    generator, reference = _gen(11), _gen(11)
    logits = _llm_like_logits(3, seed=2)
    Sampler()(logits, [params, SamplingParams(temperature=0.0), params], [generator, None, None])
    torch.rand(VOCAB, generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())


@pytest.mark.parametrize("temperature", [1e-3, 1e-6, 1e-30])
def test_temperature_to_zero_is_greedy(temperature: float) -> None:
    logits = _llm_like_logits(16, seed=3)
    params = [SamplingParams(temperature=temperature)] * 16
    out = Sampler()(logits, params, [_gen(i) for i in range(16)])
    assert torch.equal(out.token_ids, torch.argmax(logits, dim=-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1, temperature=1.5),
        SamplingParams(top_p=1e-6, temperature=2.0),
        SamplingParams(min_p=1.0, temperature=2.0),
    ],
    ids=repr,
)
def test_filters_at_their_extreme_equal_greedy(params: SamplingParams) -> None:
    logits = _llm_like_logits(32, seed=4)
    out = Sampler()(logits, [params] * 32, [_gen(i) for i in range(32)])
    assert torch.equal(out.token_ids, torch.argmax(logits, dim=-1))


def test_high_temperature_without_filters_is_not_greedy() -> None:
    # The counterpart of the greedy-limit tests: they must be able to fail.
    logits = _llm_like_logits(32, seed=4)
    out = Sampler()(logits, [SamplingParams(temperature=1.0)] * 32, [_gen(i) for i in range(32)])
    assert int((out.token_ids != torch.argmax(logits, dim=-1)).sum()) > 16


def test_min_p_never_samples_a_filtered_token() -> None:
    vocab = 64
    logits = torch.linspace(0.0, -6.0, vocab)  # p_i / p_max = exp(-6 i / 63)
    min_p = 0.1
    allowed = torch.softmax(logits, -1) >= min_p * torch.softmax(logits, -1).max()
    assert 5 < int(allowed.sum()) < vocab  # the filter actually removes something
    counts = _draw(logits, SamplingParams(min_p=min_p, temperature=1.0), 5000, seeded=False)
    assert counts[~allowed].sum() == 0
    assert (counts[allowed] > 0).all()


def test_top_k_never_samples_outside_the_k_largest() -> None:
    logits = _llm_like_logits(1, seed=5, vocab=4096)[0]
    top = set(torch.topk(logits, 20).indices.tolist())
    counts = _draw(logits, SamplingParams(top_k=20, temperature=3.0), 2000, seeded=False)
    assert set(torch.nonzero(counts).flatten().tolist()) <= top
    assert len(set(torch.nonzero(counts).flatten().tolist())) > 10


@pytest.mark.parametrize("top_p", [0.3, 0.8])
def test_wide_nucleus_is_cut_exactly(top_p: float) -> None:
    # A flat distribution puts thousands of tokens in the nucleus, so the rejected rows must
    # widen their search for its edge past the first guess.
    vocab = 8192
    logits = torch.linspace(0.0, -2.0, vocab)  # token ids are already in rank order
    params = SamplingParams(top_p=top_p)
    kept = int((_expected_distribution(logits, params) > 0).sum())
    assert kept > 4 * 256
    counts = _draw(logits, params, 600, seeded=False)
    sampled = torch.nonzero(counts).flatten()
    assert int(sampled.max()) < kept
    assert int(sampled.max()) > 0.95 * kept


def test_minus_infinity_logits_are_never_sampled() -> None:
    logits = torch.zeros(2000, 16)
    logits[:, 5:] = -torch.inf
    out = Sampler(default_generator=_gen(0))(logits, [SamplingParams()] * 2000, [None] * 2000)
    assert int(out.token_ids.max()) <= 4
    assert torch.isfinite(out.logprobs).all()


TARGET_PARAMS = [
    SamplingParams(seed=7),
    SamplingParams(seed=7, temperature=0.8, top_p=0.9),
    SamplingParams(seed=7, temperature=1.2, top_k=50, min_p=0.01),
    SamplingParams(seed=7, temperature=0.7, top_k=200, top_p=0.95, min_p=0.02),
]

NEIGHBOURS = [
    (SamplingParams(seed=1), 1),
    (SamplingParams(), None),
    (SamplingParams(temperature=0.0), None),
    (SamplingParams(top_k=10, temperature=0.5, seed=2), 2),
    (SamplingParams(top_p=0.5), None),
    # index 5 is the row under test
    (SamplingParams(min_p=0.2, temperature=2.0, seed=3), 3),
    (SamplingParams(temperature=0.0, seed=4), 4),
]


def _run_steps(sampler: Sampler, steps: list[torch.Tensor], rows: list, generators: list) -> list:
    params = [p for p, _ in rows]
    return [sampler(logits, params, generators).token_ids.tolist() for logits in steps]


def _check_seeded_reproducibility(params: SamplingParams, steps: int = 20) -> None:
    own_logits = [_llm_like_logits(1, seed=100 + t) for t in range(steps)]

    alone = _run_steps(Sampler(), own_logits, [(params, 7)], [_gen(7)])
    alone_ids = [ids[0] for ids in alone]

    rows = [*NEIGHBOURS[:5], (params, 7), *NEIGHBOURS[5:]]
    generators = [None if seed is None else _gen(seed) for _, seed in rows]
    batched_logits = []
    for t in range(steps):
        logits = _llm_like_logits(8, seed=200 + t)
        logits[5] = own_logits[t][0]
        batched_logits.append(logits)
    batched = _run_steps(Sampler(), batched_logits, rows, generators)
    assert [ids[5] for ids in batched] == alone_ids

    # Another seed gives another sequence.
    other_ids = [ids[0] for ids in _run_steps(Sampler(), own_logits, [(params, 8)], [_gen(8)])]
    assert sum(a != b for a, b in zip(other_ids, alone_ids, strict=True)) >= steps // 2
    assert len(set(alone_ids)) > steps // 2


@pytest.mark.parametrize("params", TARGET_PARAMS, ids=repr)
def test_seeded_row_is_reproducible_regardless_of_batch(params: SamplingParams) -> None:
    _check_seeded_reproducibility(params)


def test_seeded_row_is_reproducible_with_two_threads() -> None:
    # Intra-op threads split [B, V] work differently for different batch sizes.
    torch.set_num_threads(2)
    _check_seeded_reproducibility(TARGET_PARAMS[3], steps=8)


def test_logprobs_are_log_softmax_of_raw_logits_at_chosen_ids() -> None:
    logits = _llm_like_logits(5, seed=9)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, logprobs=True),
        SamplingParams(temperature=2.0, top_k=3),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler()(logits, params, [_gen(i) for i in range(5)])
    assert isinstance(out, SamplerOutput)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (5,)
    reference = torch.log_softmax(logits.double(), dim=-1)
    expected = reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1).float()
    torch.testing.assert_close(out.logprobs, expected, atol=1e-5, rtol=1e-5)
    assert out.logprobs[0] == pytest.approx(float(reference[0].max()), abs=1e-5)


def test_logprobs_hold_over_logits_spanning_hundreds_of_nats() -> None:
    # A real model's logits span far more than exp's normal range below the top one (the
    # normaliser floors those terms); every row kind must still give log_softmax exactly.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4096, generator=gen) * 60.0
    logits[3, 100:] = -torch.inf
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    ]
    for rows in ([0, 3], [0, 1, 2, 3], [1, 2]):
        batch = logits[rows]
        out = Sampler()(batch, [params[r] for r in rows], [_gen(r) for r in rows])
        reference = torch.log_softmax(batch.double(), dim=-1)
        expected = reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1).float()
        torch.testing.assert_close(out.logprobs, expected, atol=1e-5, rtol=1e-5)


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="2 logits rows, 1 params and 2 generators"):
        Sampler()(torch.zeros(2, 4), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler()(torch.zeros(4), [SamplingParams()], [None])

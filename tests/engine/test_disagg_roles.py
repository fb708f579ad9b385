"""The engine's prefill-only and decode-only roles give the colocated engine's tokens.

The KV moves between the two engines' pools layer by layer, from inside the prefill
forward pass, through the same byte ranges the transfer layer uses: between their host
pools (``kv_host``), which are the pools themselves on the CPU, or the pools a staged
engine (a GPU's, or ``kv_staging`` here) copies its device pool's layers into and uploads
its received blocks from.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.errors import ResourceExhaustedError
from engine.kv_cache import KVCache, KVCacheSpec
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.parity import assert_greedy_equal

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _copy_layer(src: KVCache, dst: KVCache, layer: int, src_blocks, dst_blocks) -> int:
    sbytes, dbytes = src.as_bytes(), dst.as_bytes()
    moved = 0
    # block by block: the two sides' runs of consecutive ids need not line up
    bb = src.spec.block_bytes
    for kv in (0, 1):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            so = src.spec.offset(layer, kv, s)
            do = dst.spec.offset(layer, kv, d)
            dbytes[do : do + bb] = sbytes[so : so + bb]
            moved += bb
    return moved


def _disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params) -> list[list[int]]:
    """Each prompt reserved on ``decode`` (its cached prefix reused), computed on
    ``prefill``, and only the blocks the reservation lacks copied across."""
    layers_seen: list[int] = []
    reserved = {}
    admitted = []
    for i, ids in enumerate(prompts):
        rid = f"r{i}"
        reserved[rid] = decode.reserve(rid, ids, params)
        admitted.append(prefill.admit_prompt(rid, ids, params))
    bs = decode.config.block_size
    moved = 0

    def on_layer(layer: int) -> None:
        nonlocal moved
        layers_seen.append(layer)
        for p in admitted:
            res = reserved[p.request_id]
            k = res.num_present_tokens // bs
            ready = prefill.stage_layer(layer, p.block_ids[k:])
            assert ready(time.monotonic() + 5)
            moved += _copy_layer(
                prefill.kv_host, decode.kv_host, layer, p.block_ids[k:], res.block_ids[k:]
            )

    outs = prefill.run_prefill(admitted, on_layer)
    assert layers_seen == list(range(prefill.model_config.num_layers))
    missing = sum(len(r.block_ids) - r.num_present_tokens // bs for r in reserved.values())
    assert moved == missing * prefill.kv_spec.block_bytes * 2 * 30
    tokens: dict[str, list[int]] = {}
    for o in outs:
        assert prefill.release(o.request_id)
        ev = decode.add_prefilled(
            o.request_id, o.token_id, o.logprob, num_cached_tokens=o.num_cached_tokens
        )
        tokens[o.request_id] = list(ev.new_token_ids)
    while decode.has_unfinished():
        for ev in decode.step():
            tokens[ev.request_id].extend(ev.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_disaggregated_roles_equal_colocated(make_engine, prompts) -> None:
    colocated = make_engine().generate(prompts, GREEDY)
    prefill = make_engine(num_kv_blocks=64)
    decode = make_engine(num_kv_blocks=200)
    # fragment the decode pool so block ids differ from the prefill side
    hold = decode.blocks.allocate(7)
    got = _disaggregated(prefill, decode, prompts, GREEDY)
    decode.blocks.free(hold)
    assert got == [r.token_ids for r in colocated]
    assert prefill.blocks.num_free_blocks == prefill.blocks.num_blocks
    assert decode.blocks.num_free_blocks == decode.blocks.num_blocks


def test_seeded_sampling_is_the_same_disaggregated(make_engine, prompts) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=99, ignore_eos=True)
    colocated = make_engine().generate(prompts[:2], seeded)
    got = _disaggregated(make_engine(num_kv_blocks=64), make_engine(), prompts[:2], seeded)
    assert got == [r.token_ids for r in colocated]


def test_prefill_worker_reuses_its_prefix_cache(make_engine, prompts) -> None:
    prefill = make_engine(num_kv_blocks=64)
    decode = make_engine(num_kv_blocks=200)
    first = _disaggregated(prefill, decode, prompts[:1], GREEDY)
    admitted = prefill.admit_prompt("again", prompts[0], GREEDY)
    assert admitted.num_cached_tokens >= 16
    prefill.release("again")
    second = _disaggregated(prefill, decode, prompts[:1], GREEDY)
    # the hit leaves fewer rows to compute: other GEMM shapes than the first time
    assert_greedy_equal(prefill, prompts[:1], second, first)


def test_reservations_are_bounded_and_cancellable(make_engine, prompts) -> None:
    decode = make_engine(num_kv_blocks=64, max_num_seqs=2)
    decode.reserve("a", prompts[0], GREEDY)
    decode.reserve("b", prompts[1], GREEDY)
    with pytest.raises(ResourceExhaustedError):
        decode.reserve("c", prompts[2], GREEDY)
    assert decode.release("a")
    assert decode.abort_request("b")
    assert not decode.release("a")
    assert decode.blocks.num_free_blocks == decode.blocks.num_blocks


def test_full_pool_is_resource_exhausted(make_engine, prompts) -> None:
    prefill = make_engine(num_kv_blocks=4)
    prefill.admit_prompt("a", prompts[1], GREEDY)
    with pytest.raises(ResourceExhaustedError):
        prefill.admit_prompt("b", prompts[1], GREEDY)
    assert prefill.release("a")
    assert prefill.blocks.num_free_blocks == prefill.blocks.num_blocks


def _host_memory(spec: KVCacheSpec) -> torch.Tensor:
    return torch.zeros(spec.total_bytes, dtype=torch.uint8)


def test_staged_pools_give_the_colocated_tokens(
    default_checkpoint, default_tokenizer, make_engine, prompts
) -> None:
    """Both engines keep their pool apart from the host pool the transfer uses (as on a
    GPU): the prefill stages each layer out, the decode uploads what arrived. A second
    prompt extends the first one's answer: its reservation finds blocks the decode engine
    computed itself (present on its pool, never in its host pool), which must not be
    overwritten by an upload."""

    def staged(blocks: int) -> LLMEngine:
        config = EngineConfig(kv_staging=True, num_kv_blocks=blocks, kv_cache_dtype="float32")
        return LLMEngine(
            config, checkpoint=default_checkpoint, tokenizer=default_tokenizer,
            kv_memory=_host_memory,
        )  # fmt: skip

    prefill, decode = staged(64), staged(200)
    assert prefill.staging is not None and decode.staging is not None
    assert prefill.kv_host is not prefill.kv
    first = _disaggregated(prefill, decode, prompts[:2], GREEDY)
    colocated = make_engine()
    assert first == [r.token_ids for r in colocated.generate(prompts[:2], GREEDY)]
    longer = prompts[0] + first[0] + default_tokenizer.encode(" Tell me more.")
    reservation = decode.reserve("probe", longer, GREEDY)
    assert reservation.num_present_tokens > len(prompts[0])  # the answer's blocks too
    present = list(reservation.block_ids[: reservation.num_present_tokens // 16])
    before = decode.kv.pool[:, :, present].clone()
    assert decode.kv_host.pool[:, :, present].ne(before).any()  # computed here, never sent
    decode.release("probe")
    second = _disaggregated(prefill, decode, [longer], GREEDY)
    # the prefill engine's hit is shorter than the colocated one's: it computes more rows at once
    want = [colocated.generate([longer], GREEDY)[0].token_ids]
    assert_greedy_equal(colocated, [longer], second, want)
    assert torch.equal(decode.kv.pool[:, :, present], before)
    # The host pools hold only what crossed: the decode's own blocks stay zero there.
    assert decode.kv_host.pool.abs().sum() < decode.kv.pool.abs().sum()

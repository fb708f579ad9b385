"""What an engine tells ``kv_export`` (the KV store's write path) and how a loaded prefix
enters its cache (``claim_blocks`` -> ``commit_loaded`` -> ``free_blocks``).

Each full block is told once, by the engine that computed it, while its bytes are still in
the pool: a prefill-only pass tells the prompt's blocks, a finished request the blocks not
told yet (in a decode worker: only its output's, the prefill worker told the prompt's);
blocks that came from the prefix cache are not told again.
"""

from __future__ import annotations

import pytest

from engine.block_hash import hash_blocks
from engine.errors import ResourceExhaustedError
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
BS = 16


def _recorder(engine) -> list[tuple[list[int], list[int]]]:
    told: list[tuple[list[int], list[int]]] = []
    engine.kv_export = lambda hashes, blocks: told.append((list(hashes), list(blocks)))
    return told


def _ids(n: int) -> list[int]:
    return [(7 * i) % 4000 + 10 for i in range(n)]


def test_a_colocated_request_tells_its_prompt_and_output_blocks_once_at_finish(make_engine):
    engine = make_engine()
    told = _recorder(engine)
    ids = _ids(70)
    (out,) = engine.generate([ids], GREEDY)
    everything = ids + out.token_ids[:-1]  # the last sampled token has no KV
    assert told == [(hash_blocks(everything, BS), told[0][1])]
    assert len(told[0][1]) == len(everything) // BS
    told.clear()
    engine.generate([ids], GREEDY)  # the prompt's blocks come from the cache now
    ((hashes, _),) = told
    assert hashes == hash_blocks(everything, BS)[4:]  # 4 = 69 // 16 blocks were a hit


def test_prefill_tells_the_prompt_and_decode_only_the_output(make_engine):
    prefill, decode = make_engine(), make_engine()
    told_p, told_d = _recorder(prefill), _recorder(decode)
    ids = _ids(50)
    res = decode.reserve("r", ids, GREEDY)
    admitted = prefill.admit_prompt("r", ids, GREEDY)
    (out,) = prefill.run_prefill([admitted])
    assert told_p == [(hash_blocks(ids, BS), list(admitted.block_ids[: len(ids) // BS]))]
    # (the KV itself is not copied: this checks only who tells what)
    decode.add_prefilled("r", out.token_id, out.logprob)
    tokens = [out.token_id]
    while decode.has_unfinished():
        tokens += [t for ev in decode.step() for t in ev.new_token_ids]
    full = hash_blocks(ids + tokens[:-1], BS)
    assert told_d == [(full[len(ids) // BS :], list(res.block_ids[len(ids) // BS : len(full)]))]


def test_loaded_blocks_become_a_prefix_hit(make_engine):
    engine = make_engine(num_kv_blocks=8)
    ids = _ids(70)
    cached, hashes = engine.prefix_hashes(ids)
    assert (cached, len(hashes)) == (0, 4)
    claimed = engine.claim_blocks(3)
    engine.commit_loaded(claimed, hashes[:3])
    assert engine.prefix_hashes(ids)[0] == 3
    admitted = engine.admit_prompt("r", ids, GREEDY)
    assert admitted.num_cached_tokens == 3 * BS
    assert admitted.block_ids[:3] == claimed
    engine.free_blocks(claimed)
    engine.run_prefill([admitted])
    engine.release("r")
    assert engine.blocks.num_free_blocks == 8
    assert engine.prefix_hashes(ids)[0] == 4  # the computed fourth block joined them
    with pytest.raises(ResourceExhaustedError):
        engine.claim_blocks(9)
    engine.blocks.check_invariants()

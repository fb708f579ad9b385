"""The gateway hashes a prompt in the block size the placements' workers run
(``prefix_hashes``): unknown before the first placement, then the workers' own, with a
mismatch logged."""

from __future__ import annotations

from structlog.testing import capture_logs

from engine.block_hash import hash_blocks
from pdserve.v1 import common_pb2, scheduler_pb2
from services.gateway.prefix_hashes import PrefixHashes

PROMPT = list(range(100))


def _worker(worker_id: str, block_size: int) -> common_pb2.WorkerInfo:
    capacity = common_pb2.WorkerCapacity(block_size=block_size)
    return common_pb2.WorkerInfo(worker_id=worker_id, capacity=capacity)


def _placement(decode: int, prefill: int | None = None) -> scheduler_pb2.Placement:
    p = scheduler_pb2.Placement(request_id="r", decode=_worker("d", decode))
    if prefill is not None:
        p.prefill.CopyFrom(_worker("p", prefill))
    return p


def test_no_hashes_until_a_placement_names_the_block_size() -> None:
    hashes = PrefixHashes("m")
    assert hashes.of(PROMPT) == ([], 0)
    hashes.learn(_placement(decode=32))
    assert hashes.of(PROMPT) == (hash_blocks(PROMPT, 32), 32)
    assert len(hashes.of(PROMPT)[0]) == 3  # 100 tokens: three full 32-token blocks


def test_the_prefill_workers_size_is_the_one_hashed_for() -> None:
    hashes = PrefixHashes("m")
    with capture_logs() as logs:
        hashes.learn(_placement(decode=16, prefill=64))
    assert hashes.of(PROMPT) == (hash_blocks(PROMPT, 64), 64)
    [warning] = [e for e in logs if e["event"] == "block_size_mismatch"]
    assert warning["block_sizes"] == [16, 64] and warning["placement"] == {"p": 64, "d": 16}


def test_a_new_size_is_logged_once_and_followed() -> None:
    hashes = PrefixHashes("m")
    with capture_logs() as logs:
        for size in (16, 16, 32, 32, 16):
            hashes.learn(_placement(decode=size))
    assert hashes.block_size == 16
    assert [e["block_sizes"] for e in logs if e["event"] == "block_size_mismatch"] == [[16, 32]]

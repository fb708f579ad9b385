"""The job machinery both transports share (``transfer/writer.py``), on real regions.

One owner thread per writer moves every job's bytes; callers only post messages. Whatever
order the layers come in and however many jobs share a writer, the destination must hold
exactly the named blocks, and nobody but the owner thread changes a job's progress.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import transfer.writer
from tests.transfer.target import (
    DST_LAYOUT,
    DST_SEED,
    SRC_LAYOUT,
    Target,
    blocks_view,
    expected_pool,
    pattern,
    source,
    wait_until,
)
from transfer import (
    JobState,
    KVLayout,
    KVRegion,
    KVSource,
    RegionWriter,
    TransferError,
    TransferResult,
    TransferTimeout,
    get_transport,
)
from transfer.writer import JobWork

pytestmark = pytest.mark.timeout(60)

SRC_IDS, DST_IDS = [0, 1, 2, 5], [5, 6, 0, 9]
# 32 MiB a layer (16 blocks of 1 MiB, keys and values), 128 MiB in all: a copy that takes
# a while, in several pieces of the shm writer.
BIG = KVLayout(
    num_layers=4, num_blocks=16, block_size=256, num_kv_heads=8, head_dim=128, dtype="float32"
)


@pytest.fixture(params=["shm", "tcp", "mooncake"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVRegion, RegionWriter]]:
    """A region (in this process) filled with the destination pattern, and a writer to it."""
    with get_transport(request.param) as target, get_transport(request.param) as initiator:
        region = target.register(DST_LAYOUT)
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
        yield region, initiator.connect(region.handle, source())


def _want(layers: list[int]) -> torch.Tensor:
    return expected_pool(DST_LAYOUT, SRC_LAYOUT, [(SRC_IDS, DST_IDS)], layers)


def _layer_landed(region: KVRegion, layer: int) -> bool:
    want = blocks_view(_want([layer]), DST_LAYOUT)[layer]
    return torch.equal(blocks_view(region.tensor, DST_LAYOUT)[layer], want)


def test_layers_move_while_the_caller_computes_before_finish(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    region, writer = pair
    job = writer.begin("req", SRC_IDS, DST_IDS, deadline=time.monotonic() + 10)
    for layer in range(3):
        job.write_layer(layer)
        # The owner moves the layer while the next one "computes": before finish().
        assert wait_until(lambda layer=layer: _layer_landed(region, layer), 5)
        time.sleep(0.05)  # the rest of that compute: the writer has counted it delivered
    assert job.state is JobState.TRANSFERRING
    job.write_layer(3)
    result = job.finish().result(10)
    per_layer = len(SRC_IDS) * 2 * SRC_LAYOUT.block_bytes
    assert (result.bytes, result.layers) == (4 * per_layer, 4)
    assert 0 <= result.wait_seconds <= result.seconds
    # The layer-wise overlap: three of four layers were there when the last was handed over.
    assert result.present_at_last_layer == 3 * per_layer
    assert job.state is JobState.SUCCESS and job.error is None
    assert torch.equal(region.tensor, _want([0, 1, 2, 3]))
    stats = writer.stats()
    assert (stats.bytes, stats.jobs, stats.failures) == (4 * per_layer, 1, 0)


def test_jobs_one_after_the_other_with_layers_in_any_order(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    region, writer = pair
    for attempt, order in enumerate([(0, 1, 2, 3), (3, 1, 0, 2), (2, 0, 3, 1)]):
        job = writer.begin(f"req-{attempt}", SRC_IDS, DST_IDS, deadline=time.monotonic() + 10)
        for layer in order:
            job.write_layer(layer)
        assert job.finish().result(10).layers == 4
        assert torch.equal(region.tensor, _want([0, 1, 2, 3]))
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))


def test_only_written_layers_move_and_a_job_with_none_succeeds(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    region, writer = pair
    job = writer.begin("some", SRC_IDS, DST_IDS, deadline=time.monotonic() + 10)
    job.write_layer(2)
    assert job.finish().result(10).layers == 1
    assert torch.equal(region.tensor, _want([2]))
    empty = writer.begin("none", [], [], deadline=time.monotonic() + 10)
    assert empty.finish().result(10).bytes == 0


def test_a_staged_layer_is_waited_for_before_its_bytes_are_read(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    """``write_layer(layer, ready)``: the owner calls ``ready(deadline)`` before reading the
    layer (a GPU engine's copy to host memory may still run); False fails the job."""
    region, writer = pair
    waited: list[tuple[int, float, bool]] = []

    def staged(layer: int, landed: bool) -> Callable[[float], bool]:
        def ready(deadline: float) -> bool:
            # Nothing of this layer has been read yet when the wait runs.
            waited.append((layer, deadline, _layer_landed(region, layer)))
            return landed

        return ready

    deadline = time.monotonic() + 10
    job = writer.begin("staged", SRC_IDS, DST_IDS, deadline=deadline)
    for layer in range(4):
        job.write_layer(layer, staged(layer, landed=True))
    assert job.finish().result(10).layers == 4
    assert torch.equal(region.tensor, _want([0, 1, 2, 3]))
    assert waited == [(layer, deadline, False) for layer in range(4)]

    region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
    job = writer.begin("stuck", SRC_IDS, DST_IDS, deadline=time.monotonic() + 10)
    job.write_layer(0, staged(0, landed=False))
    with pytest.raises(TransferTimeout, match="missed its deadline"):
        job.finish().result(10)
    assert job.state is JobState.FAILED
    assert torch.equal(region.tensor, pattern(DST_LAYOUT.total_bytes, DST_SEED))


def test_many_jobs_on_one_writer_in_parallel(pair: tuple[KVRegion, RegionWriter]) -> None:
    """Eight threads, each a request of its own size into its own destination blocks, their
    layers interleaving on one writer: every job is confirmed with its own byte count and
    every block lands in its place."""
    region, writer = pair
    sizes = [1, 2, 1, 2, 1, 2, 1, 2]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    moves = [
        ([(i + k) % SRC_LAYOUT.num_blocks for k in range(n)], list(range(s, s + n)))
        for i, (n, s) in enumerate(zip(sizes, starts, strict=True))
    ]
    results: dict[int, TransferResult] = {}

    def request(i: int) -> None:
        src_ids, dst_ids = moves[i]
        job = writer.begin(f"par-{i}", src_ids, dst_ids, deadline=time.monotonic() + 20)
        for layer in range(SRC_LAYOUT.num_layers):
            job.write_layer(layer)
            time.sleep(0.001 * (i % 3))
        results[i] = job.finish().result(20)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(moves))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    per_block = 2 * SRC_LAYOUT.num_layers * SRC_LAYOUT.block_bytes
    assert {i: r.bytes for i, r in results.items()} == {
        i: n * per_block for i, n in enumerate(sizes)
    }
    layers = list(range(SRC_LAYOUT.num_layers))
    assert torch.equal(region.tensor, expected_pool(DST_LAYOUT, SRC_LAYOUT, moves, layers))
    assert writer.stats().jobs == len(moves)


def test_a_jobs_progress_changes_only_on_its_writers_owner_thread(
    pair: tuple[KVRegion, RegionWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, writer = pair
    setters: set[int] = set()
    real = JobWork.__setattr__

    def recording(self: JobWork, name: str, value: object) -> None:
        setters.add(threading.get_ident())
        real(self, name, value)

    monkeypatch.setattr(transfer.writer.JobWork, "__setattr__", recording)
    jobs = [writer.begin(f"own-{i}", [i], [i], deadline=time.monotonic() + 10) for i in range(4)]
    for layer in range(SRC_LAYOUT.num_layers):
        for job in jobs:
            job.write_layer(layer)
    jobs[3].abort()
    for job in jobs[:3]:
        job.finish().result(10)
    with pytest.raises(TransferError, match="aborted"):
        jobs[3].outcome.result(10)
    assert setters == {writer._thread.ident}  # type: ignore[attr-defined]


def test_changing_a_jobs_progress_off_its_owner_thread_is_caught() -> None:
    made: list[JobWork] = []
    job = type("Job", (), {"outcome": None})()

    def on_its_own_thread() -> None:
        made.append(JobWork(job))  # type: ignore[arg-type]
        made[0].pending = 1  # its owner may

    thread = threading.Thread(target=on_its_own_thread)
    thread.start()
    thread.join()
    assert made[0].pending == 1
    with pytest.raises(AssertionError, match=r"JobWork\.pending set off its owner thread"):
        made[0].pending = 2


def test_bad_calls_fail_the_call_or_the_job_with_the_reason(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    _, writer = pair
    deadline = time.monotonic() + 10
    with pytest.raises(TransferError, match="destination block id 12"):
        writer.begin("ids", [0], [12], deadline=deadline)
    with pytest.raises(TransferError, match="2 source blocks but 1"):
        writer.begin("ids", [0, 1], [2], deadline=deadline)
    with pytest.raises(TransferError, match="request_id"):
        writer.begin("", [0], [0], deadline=deadline)
    with pytest.raises(TransferError, match="deadline"):
        writer.begin("nan", [0], [0], deadline=float("nan"))
    outside = writer.begin("outside", [0], [0], deadline=deadline)
    outside.write_layer(4)
    with pytest.raises(TransferError, match="'outside': layer 4 outside"):
        outside.finish().result(10)
    job = writer.begin("layers", [0], [0], deadline=deadline)
    job.write_layer(1)
    job.write_layer(1)
    with pytest.raises(TransferError, match="layer 1 of 'layers' written twice"):
        job.finish().result(10)
    first = writer.begin("twice", [0], [0], deadline=deadline)
    second = writer.begin("twice", [1], [1], deadline=deadline)
    with pytest.raises(TransferError, match="already has a transfer in flight"):
        second.outcome.result(10)
    first.write_layer(0)
    assert first.finish().result(10).layers == 1
    assert writer.stats().failures == 2  # the bad layers; the refused begin never ran


def test_an_incompatible_source_is_refused_at_connect() -> None:
    other = KVLayout(
        num_layers=4, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype="float32"
    )
    with get_transport("shm") as transport:
        region = transport.register(DST_LAYOUT)
        with pytest.raises(TransferError, match="head_dim 16 != 8"):
            transport.connect(region.handle, source(other))
        with pytest.raises(TransferError, match="flat contiguous uint8"):
            KVSource(torch.zeros(SRC_LAYOUT.total_bytes // 4), SRC_LAYOUT)
        with pytest.raises(TransferError, match="cannot hold"):
            KVSource(torch.zeros(16, dtype=torch.uint8), SRC_LAYOUT)


def test_close_fails_jobs_in_flight_and_refuses_new_ones(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    _, writer = pair
    live = writer.begin("live", [0], [0], deadline=time.monotonic() + 10)
    live.write_layer(0)
    writer.close()
    with pytest.raises(TransferError, match="closed"):
        live.finish().result(10)
    with pytest.raises(TransferError, match="closed"):
        writer.begin("late", [0], [0], deadline=time.monotonic() + 10)
    assert writer.closed


async def test_abort_from_the_event_loop_while_a_layer_is_mid_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner takes messages between the pieces of a long copy: an abort posted while a
    layer is being copied stops it there, and once the outcome is in, nothing more lands."""
    copied, resume = threading.Event(), threading.Event()
    real_copyto = np.copyto

    def copy_one_piece_then_wait(dst: np.ndarray, src: np.ndarray) -> None:
        real_copyto(dst, src)
        if not copied.is_set():
            copied.set()
            assert resume.wait(10)

    monkeypatch.setattr(np, "copyto", copy_one_piece_then_wait)
    with get_transport("shm") as transport:
        region = transport.register(BIG)
        writer = transport.connect(
            region.handle, KVSource(torch.ones(BIG.total_bytes, dtype=torch.uint8), BIG)
        )
        blocks = list(range(BIG.num_blocks))
        job = writer.begin("big", blocks, blocks, deadline=time.monotonic() + 30)
        for layer in range(BIG.num_layers):
            job.write_layer(layer)
        assert await asyncio.to_thread(copied.wait, 10)
        outcome = asyncio.wrap_future(job.abort("cancelled"))
        await asyncio.sleep(0.05)  # the abort is queued while the piece is "in flight"
        resume.set()
        with pytest.raises(TransferError, match="'big' cancelled"):
            await asyncio.wait_for(outcome, 10)
        landed = int(region.tensor.count_nonzero())
        assert 0 < landed < BIG.total_bytes  # stopped after the piece in flight
        await asyncio.sleep(0.05)
        assert int(region.tensor.count_nonzero()) == landed  # the writer stopped for good
        assert writer.stats().bytes == landed
        assert writer.stats().failures == 0  # an abort is not a failure


def test_deadline_shorter_than_the_copy_times_out_and_the_writer_stays_usable() -> None:
    with get_transport("shm") as transport:
        region = transport.register(BIG)
        src = KVSource(torch.ones(BIG.total_bytes, dtype=torch.uint8), BIG)
        writer = transport.connect(region.handle, src)
        blocks = list(range(BIG.num_blocks))
        deadline = time.monotonic() + 0.002  # far less than 128 MiB of copies
        job = writer.begin("slow", blocks, blocks, deadline=deadline)
        for layer in range(BIG.num_layers):
            job.write_layer(layer)
        with pytest.raises(TransferTimeout, match="missed its deadline"):
            job.finish().result(10)
        assert time.monotonic() - deadline < 0.5
        landed = int(region.tensor.count_nonzero())
        assert landed < BIG.total_bytes
        time.sleep(0.05)
        assert int(region.tensor.count_nonzero()) == landed  # the owner stopped
        assert writer.stats().failures == 1
        fresh = writer.begin("next", [0], [0], deadline=time.monotonic() + 10)
        fresh.write_layer(0)
        assert fresh.finish().result(10).bytes == 2 * BIG.block_bytes


def test_deadline_while_the_peer_is_stopped_then_the_writer_recovers() -> None:
    """The tcp receiver stops reading mid-job: the job fails at its deadline (its frame is
    half sent, so the connection goes), and the next job reconnects and lands."""
    layout = KVLayout(
        num_layers=2, num_blocks=16, block_size=256, num_kv_heads=8, head_dim=128, dtype="float32"
    )  # 32 MiB a layer: far more than the socket buffers hold
    blocks = list(range(layout.num_blocks))
    with get_transport("tcp") as transport, Target("tcp", layout) as target:
        writer = transport.connect(target.handle, source(layout))
        target.pause()
        try:
            started = time.monotonic()
            job = writer.begin("stuck", blocks, blocks, deadline=started + 0.5)
            for layer in range(layout.num_layers):
                job.write_layer(layer)
            with pytest.raises(TransferTimeout, match="missed its deadline"):
                job.finish().result(5)
            assert 0.45 <= time.monotonic() - started < 1.5
        finally:
            target.resume()
        assert writer.stats().failures == 1
        job = writer.begin("after", blocks, blocks, deadline=time.monotonic() + 10)
        for layer in range(layout.num_layers):
            job.write_layer(layer)
        assert job.finish().result(10).bytes == layout.total_bytes
        assert target.verify(layout, [(blocks, blocks)], list(range(layout.num_layers))) == 0

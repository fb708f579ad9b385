"""The shm transport: a target process's pool in /dev/shm, written one-sided by this process."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine.kv_cache import KVCache
from tests.transfer.target import (
    DST_LAYOUT,
    LAYERS,
    MOVE_BYTES,
    MOVES,
    SRC_LAYOUT,
    SRC_SEED,
    Target,
    pattern,
    push_requests,
    wait_until,
)
from transfer import KVLayout, MemoryRegionHandle, TransferError, TransferTimeout, shm
from transfer.shm import ShmTransport, sweep_stale_segments

pytestmark = pytest.mark.timeout(60)

# 32 MiB pool whose layers are 8 MiB each: big enough that copying it many times takes a while.
BIG = KVLayout(
    num_layers=4, num_blocks=4, block_size=256, num_kv_heads=8, head_dim=128, dtype="float32"
)


def test_writes_land_exactly_in_a_target_process_that_runs_no_code() -> None:
    with ShmTransport() as transport, Target("shm", DST_LAYOUT) as target:
        path = target.handle.address
        assert path.startswith("/dev/shm/pdserve-kv-") and os.path.exists(path)
        writer = transport.connect(target.handle)
        assert transport.connect(target.handle) is writer  # cached per region
        target.pause()  # one-sided: the target need not run at all
        try:
            results = push_requests(writer)
        finally:
            target.resume()
        assert [r.bytes for r in results] == MOVE_BYTES
        assert [r.layers for r in results] == [3, 3]
        assert target.verify(SRC_LAYOUT, MOVES, LAYERS) == 0
        # The check can fail: without the second request's blocks the pools differ.
        assert target.verify(SRC_LAYOUT, MOVES[:1], LAYERS) > 0
        stats = writer.stats()
        assert (stats.bytes, stats.jobs, stats.failures) == (sum(MOVE_BYTES), 2, 0)

        target.close()
        assert not os.path.exists(path)  # and jobs fail: see the next test


def test_a_probe_stands_for_a_while_then_a_dead_owner_fails_begin_and_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    with ShmTransport() as transport, Target("shm", DST_LAYOUT) as target:
        writer = transport.connect(target.handle)
        push_requests(writer)  # the owner was probed a moment ago
        target.close()
        # While the last probe stands, a job into the dead owner begins and even succeeds
        # (as one could whose owner died right after a probe).
        monkeypatch.setattr(shm, "_ALIVE_FOR_S", 3600.0)
        job = writer.begin("within", deadline=time.monotonic() + 5)
        job.write_blocks(0, src, SRC_LAYOUT, [0, 1], [2, 3])
        assert job.finish().bytes == 2 * 2 * SRC_LAYOUT.block_bytes
        # Once it is stale, the job's end probes and fails it ...
        job = writer.begin("ends", deadline=time.monotonic() + 5)
        job.write_blocks(0, src, SRC_LAYOUT, [0, 1], [2, 3])
        monkeypatch.setattr(shm, "_ALIVE_FOR_S", 0.0)
        with pytest.raises(TransferError, match="is gone"):
            job.finish()
        # ... and begin refuses from then on, whatever the window.
        monkeypatch.setattr(shm, "_ALIVE_FOR_S", 3600.0)
        with pytest.raises(TransferError, match="is gone"):
            writer.begin("known", deadline=time.monotonic() + 5)

    monkeypatch.setattr(shm, "_ALIVE_FOR_S", 0.0)
    with ShmTransport() as transport, Target("shm", DST_LAYOUT) as target:
        writer = transport.connect(target.handle)
        push_requests(writer)
        target.close()
        # A stale probe does not stand at begin either: begin probes and refuses.
        with pytest.raises(TransferError, match="is gone"):
            writer.begin("after", deadline=time.monotonic() + 5)
        assert writer.stats().failures == 0  # nothing began


def test_target_killed_mid_transfer_fails_the_job_and_removes_its_segment() -> None:
    with ShmTransport() as transport, Target("shm", DST_LAYOUT) as target:
        writer = transport.connect(target.handle)
        src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
        job = writer.begin("req", deadline=time.monotonic() + 10)
        job.write_blocks(0, src, SRC_LAYOUT, [0, 1], [2, 3])
        time.sleep(0.01)  # "computing": the next write hands both to the sender thread
        job.write_blocks(1, src, SRC_LAYOUT, [0, 1], [2, 3])
        assert wait_until(lambda: writer.stats().bytes > 0, 5)
        target.kill()
        time.sleep(shm._ALIVE_FOR_S)  # the last probe's answer no longer stands
        started = time.monotonic()
        with pytest.raises(TransferError, match="is gone") as failure:
            job.write_blocks(2, src, SRC_LAYOUT, [0, 1], [2, 3])
            job.finish()
        assert not isinstance(failure.value, TransferTimeout)
        assert time.monotonic() - started < 2.0
        assert not os.path.exists(target.handle.address)  # the orphan was unlinked
        assert writer.stats().failures == 1


def test_deadline_shorter_than_the_copy_times_out_and_drops_the_rest() -> None:
    with ShmTransport() as transport:
        region = transport.register(BIG)
        writer = transport.connect(region.handle)
        src = torch.ones(BIG.total_bytes, dtype=torch.uint8)
        blocks = list(range(BIG.num_blocks))
        deadline = time.monotonic() + 0.03
        job = writer.begin("slow", deadline=deadline)
        for _ in range(25):  # 800 MiB of copies queued: far more than 30 ms of work
            for layer in range(BIG.num_layers):
                job.write_blocks(layer, src, BIG, blocks, blocks)
        with pytest.raises(TransferTimeout, match="missed its deadline"):
            job.finish()
        assert time.monotonic() - deadline < 0.3
        time.sleep(0.05)
        moved = writer.stats().bytes
        time.sleep(0.1)
        assert writer.stats().bytes == moved < 25 * BIG.total_bytes  # the sender stopped
        assert writer.stats().failures == 1
        with pytest.raises(TransferTimeout):
            job.write_blocks(0, src, BIG, [0], [0])
        # The writer itself stays usable.
        fresh = writer.begin("next", deadline=time.monotonic() + 10)
        fresh.write(0, src, [(0, 0, 100)])
        assert fresh.finish().bytes == 100


def test_stats_count_exactly_the_bytes_that_landed_when_an_abort_stops_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with ShmTransport() as transport:
        region = transport.register(BIG)
        writer = transport.connect(region.handle)
        src = torch.ones(BIG.total_bytes, dtype=torch.uint8)
        blocks = list(range(BIG.num_blocks))
        job = writer.begin("stopped", deadline=time.monotonic() + 30)
        for layer in range(BIG.num_layers):
            job.write_blocks(layer, src, BIG, blocks, blocks)
        checks = []
        real = writer._stop_copying

        def abort_after_the_first_layer(job_: object, moving: int) -> bool:
            checks.append(moving)
            if len(checks) == 2:  # as if another thread aborted between two copies
                job.abort()
            return real(job_, moving)

        monkeypatch.setattr(writer, "_stop_copying", abort_after_the_first_layer)
        with pytest.raises(TransferError, match="aborted"):
            job.finish()
        landed = int(region.tensor.count_nonzero())
        assert 0 < landed < BIG.total_bytes
        assert writer.stats().bytes == landed


def test_abort_drops_queued_writes_and_is_not_a_failure() -> None:
    with ShmTransport() as transport:
        region = transport.register(BIG)
        writer = transport.connect(region.handle)
        src = torch.ones(BIG.total_bytes, dtype=torch.uint8)
        job = writer.begin("cancelled", deadline=time.monotonic() + 30)
        for _ in range(25):
            job.write(0, src, [(0, 0, BIG.total_bytes)])
        job.abort()
        job.abort()
        with pytest.raises(TransferError, match="aborted"):
            job.finish()
        time.sleep(0.05)
        moved = writer.stats().bytes
        time.sleep(0.1)
        assert writer.stats().bytes == moved < 25 * BIG.total_bytes
        assert writer.stats().failures == 0


def test_writes_outside_the_region_are_refused_before_anything_moves() -> None:
    with ShmTransport() as transport:
        region = transport.register(DST_LAYOUT)
        writer = transport.connect(region.handle)
        length = region.handle.length
        src = torch.ones(length, dtype=torch.uint8)
        job = writer.begin("req", deadline=time.monotonic() + 10)
        for bad in [(0, length - 10, 11), (0, -1, 4), (-1, 0, 4), (length, 0, 1), (0, 0)]:
            with pytest.raises(TransferError, match=r"outside|negative|must be"):
                job.write(0, src, [(0, 0, 16), bad])  # the good range must not move either
        with pytest.raises(TransferError, match="layer 4 outside"):
            job.write(4, src, [(0, 0, 16)])
        with pytest.raises(TransferError, match="flat contiguous uint8"):
            job.write(0, src.view(torch.float32), [(0, 0, 16)])
        assert job.finish().bytes == 0
        assert int(region.tensor.count_nonzero()) == 0


def test_pool_built_on_the_region_sees_the_written_blocks() -> None:
    src_cache = KVCache(SRC_LAYOUT.to_spec())
    src_cache.pool.normal_()
    with ShmTransport() as transport:
        region = transport.register(DST_LAYOUT)
        dst_cache = KVCache(DST_LAYOUT.to_spec(), buffer=region.tensor)
        job = transport.connect(region.handle).begin("req", deadline=time.monotonic() + 10)
        for layer in range(SRC_LAYOUT.num_layers):
            job.write_blocks(layer, src_cache.as_bytes(), SRC_LAYOUT, [6, 7], [0, 9])
        job.finish()
        for layer in range(SRC_LAYOUT.num_layers):
            assert torch.equal(dst_cache.keys(layer)[[0, 9]], src_cache.keys(layer)[[6, 7]])
            assert torch.equal(dst_cache.values(layer)[[0, 9]], src_cache.values(layer)[[6, 7]])
        assert int(dst_cache.pool[:, :, 1:9].count_nonzero()) == 0


def test_handles_cannot_point_a_writer_at_other_files(tmp_path: os.PathLike) -> None:
    def handle(address: str) -> MemoryRegionHandle:
        return MemoryRegionHandle("shm", address, DST_LAYOUT.total_bytes, "k", DST_LAYOUT, "r")

    outside = os.path.join(tmp_path, "pdserve-kv-x")
    with open(outside, "wb") as f:
        f.truncate(DST_LAYOUT.total_bytes)
    link = os.path.join(tmp_path, "pdserve-kv-link")
    os.symlink(outside, link)
    with ShmTransport() as transport:
        for address in [outside, "/dev/shm/../etc/passwd", "/dev/shm/not-ours"]:
            with pytest.raises(TransferError, match="is not a segment in /dev/shm"):
                transport.connect(handle(address))
    with ShmTransport(str(tmp_path)) as transport:
        with pytest.raises(TransferError, match="cannot open shm segment"):
            transport.connect(handle(link))  # symlinks are not followed
        with pytest.raises(TransferError, match="cannot open shm segment"):
            transport.connect(handle(os.path.join(tmp_path, "pdserve-kv-missing")))


def test_close_unlinks_and_sweep_removes_only_orphans(tmp_path: os.PathLike) -> None:
    shm_dir = str(tmp_path)
    with ShmTransport(shm_dir) as transport:
        live = transport.register(DST_LAYOUT)
        orphan = os.path.join(shm_dir, "pdserve-kv-orphan")
        unrelated = os.path.join(shm_dir, "unrelated")
        for path in (orphan, unrelated):
            with open(path, "wb") as f:
                f.write(b"\0" * 64)
        assert sweep_stale_segments(shm_dir) == [orphan]
        assert os.path.exists(live.path) and os.path.exists(unrelated)
        live.close()
        assert not os.path.exists(live.path)
        live.tensor[0] = 1  # the memory outlives the name: no crash, just unshared
        assert sorted(os.listdir(shm_dir)) == ["unrelated"]


def test_one_live_job_per_request_and_close_fails_jobs_in_flight() -> None:
    with ShmTransport() as transport:
        region = transport.register(DST_LAYOUT)
        writer = transport.connect(region.handle)
        live = writer.begin("a", deadline=time.monotonic() + 10)
        with pytest.raises(TransferError, match="already has a transfer in flight"):
            writer.begin("a", deadline=time.monotonic() + 10)
        forgotten = writer.begin("b", deadline=time.monotonic() - 1)  # never finished
        again = writer.begin("b", deadline=time.monotonic() + 10)  # replaces the dead one
        with pytest.raises(TransferTimeout):
            forgotten.finish()
        writer.close()
        for job in (live, again):
            with pytest.raises(TransferError, match="closed"):
                job.finish()
        with pytest.raises(TransferError, match="closed"):
            writer.begin("c", deadline=time.monotonic() + 10)
        assert transport.connect(region.handle) is not writer  # a closed writer is replaced


def _resident_kib(path: str) -> list[int]:
    """Rss of every mapping of ``path`` in this process (from /proc/self/smaps), in KiB."""
    out: list[int] = []
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = len(fields) >= 6 and fields[5] == path
            elif current and fields[0] == "Rss:":
                out.append(int(fields[1]))
    return out


def test_the_owner_maps_every_page_up_front() -> None:
    # A first touch of an unmapped page is a fault; ~30 ms for one long request's KV, which
    # the first decode step after it joined would pay while every stream waits.
    layout = KVLayout(
        num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32"
    )
    with ShmTransport() as owner, ShmTransport() as initiator:
        region = owner.register(layout)
        path = region.handle.address
        kib = layout.total_bytes // 1024
        assert _resident_kib(path) == [kib]  # the owner's mapping, before any use
        # a writer maps lazily: populating a big pool on a request's path would stall it
        writer = initiator.connect(region.handle)
        assert sorted(_resident_kib(path)) == [0, kib]
        writer.close()

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
    SRC_LAYOUT,
    Target,
    assert_pushed,
    push_requests,
    source,
    wait_until,
)
from transfer import (
    JobState,
    KVLayout,
    KVSource,
    MemoryRegionHandle,
    TransferError,
    TransferTimeout,
)
from transfer.shm import ShmTransport, sweep_stale_segments

pytestmark = pytest.mark.timeout(60)


def test_writes_land_exactly_in_a_target_process_that_runs_no_code() -> None:
    with ShmTransport() as transport, Target("shm", DST_LAYOUT) as target:
        path = target.handle.address
        assert path.startswith("/dev/shm/pdserve-kv-") and os.path.exists(path)
        src = source()
        writer = transport.connect(target.handle, src)
        assert transport.connect(target.handle, src) is writer  # cached per region and source
        target.pause()  # one-sided: the target need not run at all
        try:
            results = push_requests(writer)
        finally:
            target.resume()
        assert_pushed(writer, target, results)

        target.close()
        assert not os.path.exists(path)  # and jobs fail: see the next test


def test_a_dead_owner_fails_the_next_job_at_its_start_and_loses_its_segment() -> None:
    with ShmTransport() as transport, Target("shm", DST_LAYOUT) as target:
        writer = transport.connect(target.handle, source())
        push_requests(writer)
        target.kill()
        started = time.monotonic()
        job = writer.begin("after", [0], [0], deadline=time.monotonic() + 5)
        job.write_layer(0)
        with pytest.raises(TransferError, match="is gone") as failure:
            job.finish().result(5)
        assert not isinstance(failure.value, TransferTimeout)
        assert time.monotonic() - started < 2.0
        assert not os.path.exists(target.handle.address)  # the orphan was unlinked
        assert writer.stats().failures == 0  # refused at its start: it never ran
        # The writer retires: its mapping, the segment's last, goes; connecting again fails.
        assert writer.closed
        assert wait_until(lambda: not hasattr(writer, "_dst_rows"), 2)
        with pytest.raises(TransferError, match="cannot open shm segment"):
            transport.connect(target.handle, source())


def test_abort_drops_layers_not_yet_moved_and_is_not_a_failure() -> None:
    with ShmTransport() as transport:
        region = transport.register(DST_LAYOUT)
        writer = transport.connect(region.handle, source())
        job = writer.begin("cancelled", [0], [0], deadline=time.monotonic() + 30)
        job.abort()
        job.abort()
        job.write_layer(0)  # after the abort: never moved
        with pytest.raises(TransferError, match="aborted"):
            job.finish().result(5)
        assert job.state is JobState.FAILED and "aborted" in str(job.error)
        time.sleep(0.05)
        assert int(region.tensor.count_nonzero()) == 0
        stats = writer.stats()
        assert (stats.bytes, stats.failures) == (0, 0)


def test_pool_built_on_the_region_sees_the_written_blocks() -> None:
    src_cache = KVCache(SRC_LAYOUT.to_spec())
    src_cache.pool.normal_()
    with ShmTransport() as transport:
        region = transport.register(DST_LAYOUT)
        dst_cache = KVCache(DST_LAYOUT.to_spec(), buffer=region.tensor)
        writer = transport.connect(region.handle, KVSource(src_cache.as_bytes(), SRC_LAYOUT))
        job = writer.begin("req", [6, 7], [0, 9], deadline=time.monotonic() + 10)
        for layer in range(SRC_LAYOUT.num_layers):
            job.write_layer(layer)
        job.finish().result(10)
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
                transport.connect(handle(address), source())
    with ShmTransport(str(tmp_path)) as transport:
        with pytest.raises(TransferError, match="cannot open shm segment"):
            transport.connect(handle(link), source())  # symlinks are not followed
        with pytest.raises(TransferError, match="cannot open shm segment"):
            transport.connect(handle(os.path.join(tmp_path, "pdserve-kv-missing")), source())


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


def test_a_closed_writer_is_replaced_by_connect() -> None:
    with ShmTransport() as transport:
        region = transport.register(DST_LAYOUT)
        src = source()
        writer = transport.connect(region.handle, src)
        writer.close()
        fresh = transport.connect(region.handle, src)
        assert fresh is not writer and not fresh.closed
        assert push_requests(fresh)[0].layers == len(LAYERS)


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
        writer = initiator.connect(
            region.handle, KVSource(torch.zeros(layout.total_bytes, dtype=torch.uint8), layout)
        )
        assert sorted(_resident_kib(path)) == [0, kib]
        writer.close()

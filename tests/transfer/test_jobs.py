"""The job machinery both transports share (``transfer/sender.py``), on real regions.

Writes that come with compute between them are moved by the sender thread while the
caller computes; ``finish`` moves whatever is left itself; ``write_blocks`` copies a
request's runs for many layers at once. Whatever path the bytes take, the destination must
hold exactly the named blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from tests.transfer.target import (
    DST_LAYOUT,
    DST_SEED,
    SRC_LAYOUT,
    SRC_SEED,
    blocks_view,
    expected_pool,
    pattern,
    wait_until,
)
from transfer import KVLayout, KVRegion, RegionWriter, TransferError, get_transport, plan_ranges

pytestmark = pytest.mark.timeout(60)

SRC_IDS, DST_IDS = [0, 1, 2, 5], [5, 6, 0, 9]


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVRegion, RegionWriter]]:
    """A region (in this process) filled with the destination pattern, and a writer to it."""
    with get_transport(request.param) as target, get_transport(request.param) as initiator:
        region = target.register(DST_LAYOUT)
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
        yield region, initiator.connect(region.handle)


def _want(layers: list[int]) -> torch.Tensor:
    return expected_pool(DST_LAYOUT, SRC_LAYOUT, [(SRC_IDS, DST_IDS)], layers)


def test_writes_between_compute_move_before_finish(pair: tuple[KVRegion, RegionWriter]) -> None:
    region, writer = pair
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    job = writer.begin("req", deadline=time.monotonic() + 10)
    for layer in range(3):
        job.write_blocks(layer, src, SRC_LAYOUT, SRC_IDS, DST_IDS)
        time.sleep(0.005)  # the next layer computes
    # The sender thread took the first layers while the caller "computed".
    assert wait_until(lambda: writer.stats().bytes > 0, 5)
    job.write_blocks(3, src, SRC_LAYOUT, SRC_IDS, DST_IDS)  # finish() moves this one
    result = job.finish()
    per_layer = len(SRC_IDS) * 2 * SRC_LAYOUT.block_bytes
    assert (result.bytes, result.layers) == (4 * per_layer, 4)
    assert writer.stats().bytes == 4 * per_layer
    assert torch.equal(region.tensor, _want([0, 1, 2, 3]))


def test_finish_after_back_to_back_writes_moves_them_all(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    region, writer = pair
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    for attempt in range(3):  # jobs one after the other on one writer
        job = writer.begin(f"req-{attempt}", deadline=time.monotonic() + 10)
        for layer in (0, 1, 2, 3):
            job.write_blocks(layer, src, SRC_LAYOUT, SRC_IDS, DST_IDS)
        assert job.finish().layers == 4
        assert torch.equal(region.tensor, _want([0, 1, 2, 3]))
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))


def test_layers_in_any_order_mixed_with_explicit_writes(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    region, writer = pair
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    job = writer.begin("req", deadline=time.monotonic() + 10)
    job.write_blocks(2, src, SRC_LAYOUT, SRC_IDS, DST_IDS)
    job.write(1, src, plan_ranges(SRC_LAYOUT, DST_LAYOUT, SRC_IDS, DST_IDS, 1))
    job.write_blocks(0, src, SRC_LAYOUT, SRC_IDS, DST_IDS)
    job.write_blocks(3, src, SRC_LAYOUT, [7], [11])  # another plan in the same job
    job.write_blocks(3, src, SRC_LAYOUT, SRC_IDS, DST_IDS)
    result = job.finish()
    assert result.layers == 4
    want = expected_pool(DST_LAYOUT, SRC_LAYOUT, [(SRC_IDS, DST_IDS), ([7], [11])], [0, 1, 2, 3])
    # Block 7 -> 11 was written for layer 3 only: put back what the other layers had.
    dst_blocks = want.view(DST_LAYOUT.num_layers, 2, DST_LAYOUT.num_blocks, -1)
    before = pattern(DST_LAYOUT.total_bytes, DST_SEED).view_as(dst_blocks)
    dst_blocks[:3, :, 11] = before[:3, :, 11]
    assert torch.equal(region.tensor, want)


def test_finish_waits_for_the_batch_the_sender_is_moving() -> None:
    # 8 MiB layers: the sender is mid-copy when finish() comes.
    layout = KVLayout(
        num_layers=6, num_blocks=4, block_size=256, num_kv_heads=8, head_dim=128, dtype="float32"
    )
    src = pattern(layout.total_bytes, SRC_SEED)
    with get_transport("shm") as transport:
        region = transport.register(layout)
        writer = transport.connect(region.handle)
        for attempt in range(3):
            region.tensor.zero_()
            job = writer.begin(f"big-{attempt}", deadline=time.monotonic() + 30)
            for layer in range(layout.num_layers):
                job.write_blocks(layer, src, layout, [0, 1, 2, 3], [3, 2, 1, 0])
                time.sleep(0.001)
            assert job.finish().bytes == layout.total_bytes
            # finish() returned: every byte is in place, whoever moved it.
            got = region.tensor.view(layout.num_layers, 2, 4, -1)
            assert torch.equal(got, src.view_as(got)[:, :, [3, 2, 1, 0]])


def test_a_source_smaller_than_its_layout_is_refused_by_name(
    pair: tuple[KVRegion, RegionWriter],
) -> None:
    _, writer = pair
    short = pattern(SRC_LAYOUT.total_bytes // 2, SRC_SEED)  # layers 2 and 3 are not in it
    job = writer.begin("req", deadline=time.monotonic() + 10)
    job.write_blocks(0, short, SRC_LAYOUT, SRC_IDS, DST_IDS)
    with pytest.raises(TransferError, match=r"outside the \d+-byte src"):
        job.write_blocks(3, short, SRC_LAYOUT, SRC_IDS, DST_IDS)
    with pytest.raises(TransferError, match="layer 4 outside"):
        job.write_blocks(4, short, SRC_LAYOUT, SRC_IDS, DST_IDS)
    with pytest.raises(TransferError, match="destination block id 12"):
        job.write_blocks(0, short, SRC_LAYOUT, SRC_IDS, [5, 6, 0, 12])
    assert job.finish().layers == 1


def test_same_id_tuples_reuse_the_plan_and_changed_ids_replan(
    pair: tuple[KVRegion, RegionWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transfer.base

    region, writer = pair
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    planned: list[int] = []
    real = transfer.base.plan_blocks

    def counting(*args: object, **kwargs: object):
        planned.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(transfer.base, "plan_blocks", counting)
    src_ids, dst_ids = tuple(SRC_IDS), tuple(DST_IDS)
    job = writer.begin("tuples", deadline=time.monotonic() + 10)
    for layer in range(4):
        job.write_blocks(layer, src, SRC_LAYOUT, src_ids, dst_ids)
    assert len(planned) == 1  # the same tuples: planned once, then reused as they are
    job.finish()
    assert torch.equal(region.tensor, _want([0, 1, 2, 3]))
    # A list is mutable: equal content reuses the plan, changed content is planned anew
    # (an identity shortcut on a list could copy a changed request to stale blocks).
    region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
    ids = list(DST_IDS)
    job = writer.begin("lists", deadline=time.monotonic() + 10)
    job.write_blocks(0, src, SRC_LAYOUT, SRC_IDS, ids)
    ids[0] = 7
    job.write_blocks(1, src, SRC_LAYOUT, SRC_IDS, ids)
    assert len(planned) == 3
    job.finish()
    want = pattern(DST_LAYOUT.total_bytes, DST_SEED)
    src_blocks, want_blocks = blocks_view(src, SRC_LAYOUT), blocks_view(want, DST_LAYOUT)
    for layer, dsts in ((0, DST_IDS), (1, ids)):
        for s, d in zip(SRC_IDS, dsts, strict=True):
            want_blocks[layer, :, d] = src_blocks[layer, :, s]
    assert torch.equal(region.tensor, want)


def test_consecutive_layers_of_one_plan_queue_as_one_write(
    pair: tuple[KVRegion, RegionWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    region, writer = pair
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    moved: list[tuple[int, int, int]] = []  # (first layer, stop, bytes) of each write moved
    real = writer._move_here  # type: ignore[attr-defined]

    def recording(job: object, writes: list) -> None:
        moved.extend((w.layer, w.stop, w.nbytes) for w in writes)
        real(job, writes)

    monkeypatch.setattr(writer, "_move_here", recording)
    per_layer = len(SRC_IDS) * 2 * SRC_LAYOUT.block_bytes
    ids = (tuple(SRC_IDS), tuple(DST_IDS))
    job = writer.begin("spans", deadline=time.monotonic() + 10)
    for layer in (0, 1, 2):
        job.write_blocks(layer, src, SRC_LAYOUT, *ids)
    job.write_blocks(0, src, SRC_LAYOUT, [7], [11])  # another plan: a write of its own
    job.write_blocks(3, src, SRC_LAYOUT, *ids)  # not after layer 0 of that plan: its own
    result = job.finish()
    assert moved == [
        (0, 3, 3 * per_layer),
        (0, 1, 2 * SRC_LAYOUT.block_bytes),
        (3, 4, per_layer),
    ]
    assert (result.bytes, result.layers) == (4 * per_layer + 2 * SRC_LAYOUT.block_bytes, 4)
    want = expected_pool(DST_LAYOUT, SRC_LAYOUT, [(SRC_IDS, DST_IDS), ([7], [11])], [0, 1, 2, 3])
    dst_blocks = want.view(DST_LAYOUT.num_layers, 2, DST_LAYOUT.num_blocks, -1)
    before = pattern(DST_LAYOUT.total_bytes, DST_SEED).view_as(dst_blocks)
    dst_blocks[1:, :, 11] = before[1:, :, 11]  # block 7 -> 11 went in layer 0 only
    assert torch.equal(region.tensor, want)


class _Clock:
    """A monotonic clock the test advances by hand (the clock writes are stamped with)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import transfer.sender

    fake = _Clock()
    monkeypatch.setattr(transfer.sender, "_monotonic", fake)
    return fake


def test_back_to_back_writes_never_extend_a_write_the_sender_took(
    pair: tuple[KVRegion, RegionWriter], clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back-to-back writes extend the open write without the writer's lock; once the sender
    was handed the job, the next write must not touch what it took, however soon it comes."""
    import threading

    region, writer = pair
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    ids = (tuple(SRC_IDS), tuple(DST_IDS))
    entered, release = threading.Event(), threading.Event()
    taken: list[tuple[object, int, int]] = []  # (write, layer, stop) as the sender got them
    real = writer._move  # type: ignore[attr-defined]

    def held(job: object, writes: list) -> None:
        if threading.current_thread() is threading.main_thread():
            real(job, writes)  # finish() moving the rest (a transport may move here too)
            return
        taken.extend((w, w.layer, w.stop) for w in writes)
        entered.set()
        assert release.wait(10)
        real(job, writes)

    monkeypatch.setattr(writer, "_move", held)
    job = writer.begin("handed", deadline=time.monotonic() + 30)
    job.write_blocks(0, src, SRC_LAYOUT, *ids)
    clock.advance(0.01)  # the next layer computed: this write hands layers 0-1 to the sender
    job.write_blocks(1, src, SRC_LAYOUT, *ids)
    assert entered.wait(10)
    clock.advance(1e-6)  # back to back with the last write
    job.write_blocks(2, src, SRC_LAYOUT, *ids)
    release.set()
    job.write_blocks(3, src, SRC_LAYOUT, *ids)
    result = job.finish()
    assert [(layer, stop) for _, layer, stop in taken] == [(0, 2)]
    assert [(w.layer, w.stop) for w, _, _ in taken] == [(0, 2)]  # unchanged after it took it
    assert result.layers == 4
    assert torch.equal(region.tensor, _want([0, 1, 2, 3]))


@pytest.mark.parametrize("end", ["finish", "abort", "close", "deadline"])
def test_a_write_back_to_back_after_the_job_ended_is_refused(
    pair: tuple[KVRegion, RegionWriter], clock: _Clock, end: str
) -> None:
    _, writer = pair
    src = pattern(SRC_LAYOUT.total_bytes, SRC_SEED)
    ids = (tuple(SRC_IDS), tuple(DST_IDS))
    job = writer.begin("ended", deadline=clock.now + (30e-6 if end == "deadline" else 30))
    job.write_blocks(0, src, SRC_LAYOUT, *ids)
    clock.advance(1e-6)
    job.write_blocks(1, src, SRC_LAYOUT, *ids)  # extends the open write
    if end == "finish":
        job = writer.begin("ended-f", deadline=time.monotonic() + 30)
        job.write_blocks(0, src, SRC_LAYOUT, *ids)
        job.finish()
        error = "already finished"
    elif end == "abort":
        job.abort()
        error = "aborted"
    elif end == "close":
        writer.close()
        error = "closed"
    else:
        error = "missed its deadline"
    clock.advance(40e-6)  # under WAKE_GAP_S since the last write; past the short deadline
    with pytest.raises(TransferError, match=error):
        job.write_blocks(1 if end == "finish" else 2, src, SRC_LAYOUT, *ids)

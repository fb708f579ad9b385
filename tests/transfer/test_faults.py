"""Fault plans: parsed strictly, refused in production unless forced, and obeyed by both
transports' writers (a failed job is FAILED with an injected error and nothing hangs; a
stalled writer moves bytes after an abort that came while it was frozen)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from tests.transfer.target import DST_LAYOUT, DST_SEED, pattern, source, wait_until
from transfer import JobState, KVRegion, RegionWriter, TransferError, get_transport
from transfer.faults import FaultDice, FaultSpec, InjectedFault

pytestmark = pytest.mark.timeout(60)

SRC_IDS, DST_IDS = [0, 1], [3, 4]


def test_parse_round_trips_and_names_bad_parts() -> None:
    plan = FaultSpec.parse("fail_rate=0.05, delay_ms=2,seed=9", production=False)
    assert plan == FaultSpec(fail_rate=0.05, delay_ms=2.0, seed=9)
    assert FaultSpec.parse(str(plan), production=False) == plan
    assert not FaultSpec.parse("", production=True).active
    with pytest.raises(ValueError, match="'nope=1' is not one of"):
        FaultSpec.parse("nope=1")
    with pytest.raises(ValueError, match="fail_every='x' is not a int"):
        FaultSpec.parse("fail_every=x")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        FaultSpec.parse("fail_rate=1.5")


def test_production_refuses_a_plan_unless_forced() -> None:
    with pytest.raises(ValueError, match="refused in production"):
        FaultSpec.parse("stall_ms=10", production=True)
    assert FaultSpec.parse("stall_ms=10,force=1", production=True).stall_ms == 10


def test_dice_fail_every_and_rate_are_seeded() -> None:
    every = FaultDice(FaultSpec(fail_every=3))
    assert [every.job_fate()[0] for _ in range(6)] == [False, False, True, False, False, True]
    a = FaultDice(FaultSpec(fail_rate=0.3, seed=4))
    b = FaultDice(FaultSpec(fail_rate=0.3, seed=4))
    fates = [a.job_fate()[0] for _ in range(200)]
    assert fates == [b.job_fate()[0] for _ in range(200)]
    assert 30 < sum(fates) < 90


@pytest.fixture(params=["shm", "tcp"])
def faulty(request: pytest.FixtureRequest) -> Iterator[tuple[KVRegion, RegionWriter, str]]:
    """A region and a writer to it from a transport that injects the test's ``faults`` marker."""
    with get_transport(request.param) as target, get_transport(request.param) as initiator:
        region = target.register(DST_LAYOUT)
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
        spec = request.node.get_closest_marker("faults").args[0]
        initiator.inject_faults(FaultSpec.parse(spec))
        yield region, initiator.connect(region.handle, source()), request.param


@pytest.mark.faults("fail_every=2,drop_every=4")
def test_injected_failures_fail_jobs_cleanly(faulty) -> None:
    _, writer, _ = faulty
    states = []
    for i in range(4):
        job = writer.begin(f"r{i}", SRC_IDS, DST_IDS, deadline=time.monotonic() + 10)
        for layer in range(DST_LAYOUT.num_layers):
            job.write_layer(layer)
        job.finish()
        try:
            job.outcome.result(10)
        except InjectedFault as exc:
            assert "injected fault" in str(exc)
        except TransferError as exc:  # a dropped connection fails the jobs bound to it
            assert "dropped" in str(exc), exc
        states.append(job.state)
    assert states == [JobState.SUCCESS, JobState.FAILED, JobState.SUCCESS, JobState.FAILED]


@pytest.mark.faults("stall_ms=600")
def test_a_stalled_writer_writes_after_an_abort_it_could_not_see(faulty) -> None:
    """The reason for KV fencing: an abort does not stop a writer that is frozen; only its
    outcome (or its deadline plus a grace) says it stopped."""
    region, writer, _ = faulty
    before = region.tensor.clone()
    job = writer.begin("late", SRC_IDS, DST_IDS, deadline=time.monotonic() + 10)
    job.write_layer(0)
    time.sleep(0.2)  # the owner took the layer and froze before moving it
    job.abort("cancelled")
    with pytest.raises(TransferError):
        job.outcome.result(10)
    assert wait_until(lambda: not torch.equal(region.tensor, before), 5), "no late write"

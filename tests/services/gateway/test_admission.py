"""The admission policy (pure) and its owner: slots handed over in FIFO order, the queue's
bound and deadline, draining, token buckets per key, and no slot leaked by a caller that
leaves while it waits."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import (
    Admission,
    AdmissionLimits,
    Bucket,
    Decision,
    Overloaded,
    RateLimited,
    decide,
    take_token,
)
from services.gateway.backend import BackendUnavailableError


def test_decide_admits_queues_then_refuses() -> None:
    limits = AdmissionLimits(2, max_queued=1)
    assert decide(limits, 0, 0) is Decision.ADMIT
    assert decide(limits, 1, 0) is Decision.ADMIT
    assert decide(limits, 2, 0) is Decision.QUEUE
    assert decide(limits, 1, 1) is Decision.REFUSE  # a free slot, but one waits ahead: FIFO
    assert decide(limits, 2, 1) is Decision.REFUSE
    assert decide(AdmissionLimits(1), 1, 0) is Decision.REFUSE  # no queue


def test_token_bucket() -> None:
    b, wait = take_token(None, 0.0, rate=2.0, burst=2)
    assert (b, wait) == (Bucket(1.0, 0.0), 0.0)
    b, wait = take_token(b, 0.0, rate=2.0, burst=2)
    assert wait == 0.0
    b, wait = take_token(b, 0.0, rate=2.0, burst=2)
    assert wait == pytest.approx(0.5)  # one token every 0.5 s
    b, wait = take_token(b, 10.0, rate=2.0, burst=2)
    assert wait == 0.0 and b.tokens == pytest.approx(1.0)  # refilled to the burst, not past


@pytest.mark.parametrize(
    "bad", [{"max_concurrent": 0}, {"max_queued": -1}, {"queue_timeout_s": 0}, {"burst": 0}]
)
def test_limits_are_checked(bad) -> None:
    with pytest.raises(ValueError):
        AdmissionLimits(**{"max_concurrent": 1, **bad})


async def _holder(adm: Admission, release: asyncio.Event, key: str = "k") -> None:
    async with adm.slot(key):
        await release.wait()


@pytest.mark.asyncio
async def test_slots_pass_to_waiters_in_order_and_the_queue_is_bounded() -> None:
    refused: list[str] = []
    adm = Admission(AdmissionLimits(1, max_queued=2, queue_timeout_s=30), on_refused=refused.append)
    first = asyncio.Event()
    t1 = asyncio.create_task(_holder(adm, first))
    await asyncio.sleep(0)
    order: list[int] = []

    async def waiter(i: int) -> None:
        async with adm.slot("k"):
            order.append(i)

    w = [asyncio.create_task(waiter(i)) for i in range(2)]
    await asyncio.sleep(0)
    assert (adm.in_flight, adm.queued) == (1, 2)
    with pytest.raises(Overloaded) as info:
        async with adm.slot("k"):
            pass
    assert info.value.retry_after_s > 0 and refused == ["overloaded"]
    first.set()
    await asyncio.gather(t1, *w)
    assert order == [0, 1] and (adm.in_flight, adm.queued) == (0, 0)


@pytest.mark.asyncio
async def test_a_wait_past_the_deadline_is_refused_and_a_cancelled_waiter_leaks_nothing() -> None:
    adm = Admission(AdmissionLimits(1, max_queued=2, queue_timeout_s=0.05))
    release = asyncio.Event()
    holder = asyncio.create_task(_holder(adm, release))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="no slot freed within"):
        async with adm.slot("k"):
            pass
    leaving = asyncio.create_task(_holder(adm, asyncio.Event()))
    await asyncio.sleep(0)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    release.set()
    await holder
    assert (adm.in_flight, adm.queued) == (0, 0)


@pytest.mark.asyncio
async def test_draining_refuses_new_and_waiting_requests() -> None:
    refused: list[str] = []
    adm = Admission(AdmissionLimits(1, max_queued=1, queue_timeout_s=30), on_refused=refused.append)
    release = asyncio.Event()
    holder = asyncio.create_task(_holder(adm, release))
    await asyncio.sleep(0)
    queued = asyncio.create_task(_holder(adm, asyncio.Event()))
    await asyncio.sleep(0)
    adm.start_draining()
    with pytest.raises(BackendUnavailableError):
        await queued
    with pytest.raises(BackendUnavailableError):
        async with adm.slot("k"):
            pass
    release.set()
    await holder  # in flight when draining began: finishes
    assert adm.in_flight == 0 and refused == ["draining", "draining"]


@pytest.mark.asyncio
async def test_rate_limits_are_per_key() -> None:
    now = [0.0]
    adm = Admission(AdmissionLimits(8, rate_per_key=1.0, burst=1), clock=lambda: now[0])
    async with adm.slot("a"):
        pass
    with pytest.raises(RateLimited) as info:
        async with adm.slot("a"):
            pass
    assert info.value.retry_after_s == pytest.approx(1.0)
    async with adm.slot("b"):
        pass
    now[0] = 1.0
    async with adm.slot("a"):
        pass


@pytest.mark.asyncio
async def test_the_cap_follows_the_fleet_s_target_batch() -> None:
    adm = Admission(AdmissionLimits(1, max_queued=3, queue_timeout_s=30, follow_fleet=True))
    release = asyncio.Event()
    holders = [asyncio.create_task(_holder(adm, release, f"k{i}")) for i in range(3)]
    await asyncio.sleep(0)
    assert (adm.in_flight, adm.queued) == (1, 2)
    adm.follow(0)  # not known: nothing changes
    assert adm.limits.max_concurrent == 1
    adm.follow(3)  # the fleet runs 3: the waiters get their slots at once, in order
    await asyncio.sleep(0)
    assert (adm.limits.max_concurrent, adm.in_flight, adm.queued) == (3, 3, 0)
    seen: list[int] = []

    async def counted(i: int) -> None:
        async with adm.slot(f"m{i}"):
            seen.append(adm.in_flight)
            await release.wait()

    more = [asyncio.create_task(counted(i)) for i in range(4)]
    await asyncio.sleep(0)
    assert (adm.in_flight, adm.queued) == (3, 3)  # the queue keeps its bound: the 4th refused
    assert isinstance(more[3].exception(), Overloaded)
    adm.follow(1)  # smaller: nothing running is cut, and the waiters go one at a time
    assert adm.in_flight == 3
    release.set()
    await asyncio.gather(*holders, *more[:3])
    assert seen == [1, 1, 1] and (adm.in_flight, adm.queued) == (0, 0)


@pytest.mark.asyncio
async def test_a_given_cap_ignores_the_fleet() -> None:
    adm = Admission(AdmissionLimits(2, max_queued=2))
    adm.follow(10)
    assert adm.limits.max_concurrent == 2

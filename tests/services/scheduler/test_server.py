"""The scheduler's edge converts the batch target a worker reports, and the fleet's, both
ways (``services/scheduler/server.py``)."""

from __future__ import annotations

from pdserve.v1 import scheduler_pb2
from services.scheduler.model import Placement, PrefillMode, Role
from services.scheduler.server import heartbeat_from_pb, placement_to_pb
from tests.services.scheduler.builders import info


def test_a_heartbeat_carries_the_worker_s_batch_target() -> None:
    for target in (0, 3):
        report = heartbeat_from_pb(
            scheduler_pb2.HeartbeatRequest(
                worker_id="d1",
                state=scheduler_pb2.WORKER_STATE_SERVING,
                load=scheduler_pb2.LoadSnapshot(total_kv_blocks=10, target_batch=target),
            )
        )
        assert report.load.target_batch == target


def test_a_placement_carries_the_fleet_s_batch_target() -> None:
    placement = Placement(
        "r1", 0, info("d1", Role.DECODE), None, PrefillMode.LOCAL_FALLBACK, fleet_target_batch=11
    )
    assert placement_to_pb(placement).fleet_target_batch == 11

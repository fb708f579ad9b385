"""The fault-injection setting every service takes (``--faults`` / ``PDSERVE_FAULTS``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.settings import setting

if TYPE_CHECKING:  # transfer pulls in torch: not for --help
    from transfer.faults import FaultPlan


@dataclass(frozen=True)
class FaultArgs:
    faults: str = setting(
        "",
        "fault injection for tests and chaos runs, key=value pairs (transfer/faults.py): KV "
        "writes fail_rate, fail_every, delay_ms, stall_ms, drop_every; internal gRPC calls "
        "rpc_fail_every, rpc_delay_ms; seed. Refused when PDSERVE_PRODUCTION=1 unless "
        "force=1. Empty: none",
        metavar="PLAN",
        env="PDSERVE_FAULTS",
    )

    def __post_init__(self) -> None:
        if self.faults:
            self.plan  # noqa: B018 (validates: a bad plan is a usage error)

    @property
    def plan(self) -> FaultPlan:
        from transfer.faults import FaultPlan

        return FaultPlan.parse(self.faults)

"""The KV data plane: move KV blocks one-sided into a peer's registered pool.

The contract and the job lifecycle are in ``transfer/base.py``; the design in DESIGN.md.
"""

from transfer.base import (
    KVRegion,
    RegionWriter,
    TransferJob,
    TransferResult,
    TransferStats,
    Transport,
)
from transfer.errors import IncompatibleLayoutError, TransferError, TransferTimeout
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.plan import BlockPlan, ByteRange, plan_blocks, plan_ranges
from transfer.registry import get_transport, known_transports

__all__ = [
    "BlockPlan",
    "ByteRange",
    "IncompatibleLayoutError",
    "KVLayout",
    "KVRegion",
    "MemoryRegionHandle",
    "RegionWriter",
    "TransferError",
    "TransferJob",
    "TransferResult",
    "TransferStats",
    "TransferTimeout",
    "Transport",
    "get_transport",
    "known_transports",
    "plan_blocks",
    "plan_ranges",
]

"""The KV data plane: move KV blocks one-sided into a peer's registered pool.

The contract and a job's lifecycle are in ``transfer/base.py``; the owner-thread model in
``transfer/writer.py``; the design in DESIGN.md.
"""

from transfer.base import (
    JobState,
    KVRegion,
    KVSource,
    RegionWriter,
    TransferJob,
    TransferResult,
    TransferStats,
    Transport,
)
from transfer.block_runs import BlockRuns, ByteRange, block_runs, layer_ranges
from transfer.errors import IncompatibleLayoutError, TransferError, TransferTimeout
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.registry import get_transport, known_transports

__all__ = [
    "BlockRuns",
    "ByteRange",
    "IncompatibleLayoutError",
    "JobState",
    "KVLayout",
    "KVRegion",
    "KVSource",
    "MemoryRegionHandle",
    "RegionWriter",
    "TransferError",
    "TransferJob",
    "TransferResult",
    "TransferStats",
    "TransferTimeout",
    "Transport",
    "block_runs",
    "get_transport",
    "known_transports",
    "layer_ranges",
]

"""The store a ``KVStore`` keeps blocks in: Mooncake Store, the seeds' own.

A ``mooncake_master`` (``kvstore.master``) holds the metadata of a deployment's store; every
process that mounts a segment lends that much of its DRAM to the pool, and any process
reads any object from whichever segment (or SSD tier) holds it, one-sided through
Mooncake's Transfer Engine (RDMA where NICs exist, TCP here). Objects outlive the process
that put them only while the segment holding them lives: a segment dies with its process,
and a master restart forgets every object (docs/operations.md, "KV store").

Every call blocks (the store's own RPC and transfer timeouts bound it); ``KVStore`` calls
them from its own threads, never the engine's or the event loop's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


class StoreUnavailable(Exception):
    """The store cannot be set up (no master there, no Mooncake installed)."""


class StoreBackend(Protocol):
    """Batched, zero-copy object I/O between registered buffers and the store."""

    def register(self, address: int, nbytes: int) -> None:
        """Make ``[address, address + nbytes)`` usable by ``put_from`` and ``get_into``."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key names an object now (False where the store cannot tell)."""

    def put_from(self, keys: Sequence[str], addresses: Sequence[int], size: int) -> list[bool]:
        """Store ``size`` bytes at each address under its key; whether each was stored
        (an object already there counts as stored)."""

    def get_into(self, keys: Sequence[str], addresses: Sequence[int], size: int) -> list[int]:
        """Read each key's object into its address (room for ``size`` bytes); its size, or
        a negative number where it could not be read."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class MooncakeOptions:
    """Where the store's master is and what this process lends to the pool."""

    master: str  # host:port of mooncake_master's RPC service
    host: str  # the address peers reach this process's segment at
    segment_bytes: int  # DRAM this process mounts into the pool (0: none, reads only)
    protocol: str = "tcp"  # "rdma" where NICs exist
    devices: str = ""  # RDMA devices, comma-separated ("" all)
    ssd_dir: str = ""  # an existing directory: this process's SSD tier ("" none)
    replicas: int = 1  # copies of each object, in distinct segments (as many as there are)


# Mooncake's error codes a put treats as "already stored".
_EXISTS = (-706,)  # OBJECT_ALREADY_EXISTS
# Buffer the client keeps for its own copies: we only use registered buffers.
_LOCAL_BUFFER_BYTES = 16 << 20


class MooncakeBackend:
    """A ``StoreBackend`` on ``mooncake.store.MooncakeDistributedStore``."""

    def __init__(self, options: MooncakeOptions) -> None:
        """Mount this process's segment; ``StoreUnavailable`` when the master is not there
        or Mooncake is not installed."""
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise StoreUnavailable(
                "the KV store needs Mooncake: pip install mooncake-transfer-engine-non-cuda "
                "(or mooncake-transfer-engine on CUDA hosts)"
            ) from e
        if options.ssd_dir:
            # Mooncake's offload writes only full buckets on a 10 s heartbeat by default:
            # write each object as it comes, every second (found the hard way: the
            # defaults kept a small store's SSD tier empty).
            os.environ.setdefault("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1")
            os.environ.setdefault("MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT", "1")
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            options.host,
            "P2PHANDSHAKE",
            options.segment_bytes,
            _LOCAL_BUFFER_BYTES,
            options.protocol,
            options.devices,
            options.master,
            None,
            bool(options.ssd_dir),
            options.ssd_dir,
        )
        if rc != 0:
            raise StoreUnavailable(f"mooncake store setup against {options.master} failed ({rc})")
        self.options = options
        self._put_config = ReplicateConfig()
        self._put_config.replica_num = options.replicas

    def register(self, address: int, nbytes: int) -> None:
        rc = self._store.register_buffer(address, nbytes)
        if rc != 0:
            raise StoreUnavailable(f"registering {nbytes} bytes with the store failed ({rc})")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [r == 1 for r in self._store.batch_is_exist(list(keys))]

    def put_from(self, keys: Sequence[str], addresses: Sequence[int], size: int) -> list[bool]:
        results = self._store.batch_put_from(
            list(keys), list(addresses), [size] * len(keys), self._put_config
        )
        return [r == 0 or r in _EXISTS for r in results]

    def get_into(self, keys: Sequence[str], addresses: Sequence[int], size: int) -> list[int]:
        return list(self._store.batch_get_into(list(keys), list(addresses), [size] * len(keys)))

    def close(self) -> None:
        self._store.close()

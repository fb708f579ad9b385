"""Transports by name: the one place a worker's ``--kv-transport`` flag is resolved."""

from __future__ import annotations

from typing import Any

from transfer.base import Transport
from transfer.cuda_ipc import CudaIpcTransport
from transfer.errors import TransferError
from transfer.mooncake import MooncakeTransport
from transfer.shm import ShmTransport
from transfer.tcp import TcpTransport

_TRANSPORTS: dict[str, type[Transport]] = {
    ShmTransport.name: ShmTransport,
    TcpTransport.name: TcpTransport,
    CudaIpcTransport.name: CudaIpcTransport,
    MooncakeTransport.name: MooncakeTransport,
}
# RDMA is a protocol of the mooncake transport, not a transport of its own.
_PLANNED = {
    "rdma": "RDMA runs through the mooncake transport: --kv-transport mooncake "
    "(--mooncake-protocol rdma or auto)",
}


def known_transports() -> tuple[str, ...]:
    return tuple(sorted(_TRANSPORTS))


def get_transport(name: str, **opts: Any) -> Transport:
    """A new transport ``name`` built with ``opts``; ``TransferError`` for an unknown name,
    a planned but unwritten one, or options the transport does not take."""
    if name in _PLANNED:
        raise TransferError(_PLANNED[name])
    cls = _TRANSPORTS.get(name)
    if cls is None:
        raise TransferError(f"unknown transport {name!r}; known: {', '.join(known_transports())}")
    try:
        return cls(**opts)
    except TypeError as exc:
        raise TransferError(f"bad options for transport {name!r}: {exc}") from exc

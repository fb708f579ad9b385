"""Fault injection in a service process, for tests and chaos runs: the ``--faults`` setting
every service takes (``FaultArgs``) and what its spec does to this process's internal gRPC
clients. The spec itself, and what it does to KV writes, is ``transfer.faults``.

``install_rpc_faults(spec)`` once at start (``process.run``, from the service's ``--faults``
/ ``PDSERVE_FAULTS``); ``cluster_auth.channel`` then adds ``rpc_fault_interceptors()`` to
every internal channel: each unary or server-streaming call waits ``rpc_delay_ms`` first,
and every ``rpc_fail_every``-th call fails with ``UNAVAILABLE`` ("injected fault") without
being sent, as a dropped connection would.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from services.common.settings import setting

if TYPE_CHECKING:  # transfer pulls in torch: not for --help
    from transfer.faults import FaultSpec


@dataclass(frozen=True)
class FaultArgs:
    faults: str = setting(
        "",
        "fault injection for tests and chaos runs, key=value pairs (transfer/faults.py): KV "
        "writes fail_rate, fail_every, delay_ms, stall_ms, drop_every; internal gRPC calls "
        "rpc_fail_every, rpc_delay_ms; seed. Refused with --production unless force=1. "
        "Empty: none",
        metavar="PLAN",
        env="PDSERVE_FAULTS",
    )
    production: bool = setting(
        False,
        "a production deployment: a --faults spec is refused unless it says force=1",
        env="PDSERVE_PRODUCTION",
    )

    def __post_init__(self) -> None:
        if self.faults:
            self.spec  # noqa: B018 (validates: a bad spec is a usage error)

    @property
    def spec(self) -> FaultSpec:
        from transfer.faults import FaultSpec

        return FaultSpec.parse(self.faults, production=self.production)


_spec: FaultSpec | None = None  # None: no faults
_calls = itertools.count(1)


def install_rpc_faults(spec: FaultSpec | None) -> None:
    """Make ``spec``'s gRPC faults this process's (None: none)."""
    global _spec
    _spec = spec if spec is not None and spec.rpc_active else None


def rpc_fault_interceptors() -> list[Any]:
    """The client interceptors the installed spec needs (none without RPC faults)."""
    return [] if _spec is None else [_UnaryUnary(), _UnaryStream()]


async def _before_call(method: object) -> None:
    if _spec is None:
        return
    if _spec.rpc_delay_ms:
        await asyncio.sleep(_spec.rpc_delay_ms / 1000)
    if _spec.rpc_fail_every and next(_calls) % _spec.rpc_fail_every == 0:
        name = method.decode() if isinstance(method, bytes) else str(method)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"injected fault: {name} not sent",
        )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        await _before_call(details.method)
        return await continuation(details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        await _before_call(details.method)
        return await continuation(details, request)

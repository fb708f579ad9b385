"""Fault injection for this process's internal gRPC clients (tests and chaos runs).

``install(plan)`` once at start (``process.run``, from the service's ``--faults`` /
``PDSERVE_FAULTS``); ``cluster_auth.channel`` then adds ``interceptors()`` to every internal
channel: each unary or server-streaming call waits ``rpc_delay_ms`` first, and every
``rpc_fail_every``-th call fails with ``UNAVAILABLE`` ("injected fault") without being sent,
as a dropped connection would.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # transfer pulls in torch: not for --help
    from transfer.faults import FaultPlan

_plan: FaultPlan | None = None  # None: no faults
_calls = itertools.count(1)


def install(plan: FaultPlan | None) -> None:
    global _plan
    _plan = plan if plan is not None and plan.rpc_active else None


def installed() -> FaultPlan | None:
    return _plan


async def _before_call(method: object) -> None:
    if _plan is None:
        return
    if _plan.rpc_delay_ms:
        await asyncio.sleep(_plan.rpc_delay_ms / 1000)
    if _plan.rpc_fail_every and next(_calls) % _plan.rpc_fail_every == 0:
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


def interceptors() -> list[Any]:
    """The client interceptors the installed plan needs (none without RPC faults)."""
    return [] if _plan is None else [_UnaryUnary(), _UnaryStream()]

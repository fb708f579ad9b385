"""One mapping from internal errors to gRPC status codes, used by every servicer."""

from __future__ import annotations

import grpc

from engine.errors import CapacityError, InvalidRequestError, ResourceExhaustedError
from transfer.errors import IncompatibleLayoutError, TransferError, TransferTimeout

# Trailing metadata between the workers and the gateway (docs/api.md, "Metadata keys").
# On DecodeWorker.Generate's error when its Prefill failed: the prefill worker at fault.
FAILED_WORKER_KEY = "pdserve-failed-worker-id"
# On Prefill's error when the writer is known to have stopped: the blocks are free now.
KV_FENCED = ("pdserve-kv-fenced", "1")


def kv_fenced(e: grpc.aio.AioRpcError) -> bool:
    """Whether a failed Prefill call says its writer stopped (``KV_FENCED``)."""
    return KV_FENCED in tuple(e.trailing_metadata() or ())


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, InvalidRequestError | CapacityError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, ResourceExhaustedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, IncompatibleLayoutError):  # the two pools cannot exchange blocks
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, TransferTimeout | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, TransferError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status for ``exc`` and its message (never returns)."""
    await context.abort(status_for(exc), f"{type(exc).__name__}: {exc}")

"""Which broken decode streams the gateway moves, and whom it blames (pure policy)."""

from __future__ import annotations

import grpc
import pytest

from services.common.grpc_errors import FAILED_WORKER_KEY
from services.gateway.cluster_backend import _broken


def _error(code: grpc.StatusCode, failed: str | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(*(((FAILED_WORKER_KEY, failed),) if failed else ()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="boom")


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
     grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED],
)  # fmt: skip
def test_a_lost_decode_worker_is_blamed_and_the_request_moves(code) -> None:
    b = _broken(_error(code), "decode-1")
    assert b is not None and (b.cause, b.worker_id) == ("decode_lost", "decode-1")


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
     grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED],
)  # fmt: skip
def test_a_failed_prefill_blames_the_prefill_worker(code) -> None:
    b = _broken(_error(code, failed="prefill-0"), "decode-1")
    assert b is not None and (b.cause, b.worker_id) == ("prefill_failed", "prefill-0")


@pytest.mark.parametrize(
    ("code", "failed"),
    [(grpc.StatusCode.INVALID_ARGUMENT, None), (grpc.StatusCode.INVALID_ARGUMENT, "prefill-0"),
     (grpc.StatusCode.OUT_OF_RANGE, "prefill-0"), (grpc.StatusCode.RESOURCE_EXHAUSTED, None),
     (grpc.StatusCode.DEADLINE_EXCEEDED, None), (grpc.StatusCode.PERMISSION_DENIED, None)],
)  # fmt: skip
def test_the_request_at_fault_is_not_moved(code, failed) -> None:
    assert _broken(_error(code, failed), "decode-1") is None

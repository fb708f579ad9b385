"""Which broken decode streams the gateway moves, whom it blames, and when it stops: a lost
worker moves the request up to the budget; a failure that may be the request's own moves
it once (pure policy, ``services/gateway/migration.py``)."""

from __future__ import annotations

import grpc
import pytest

from services.common.convert import FAILED_WORKER_KEY
from services.gateway.cluster_backend import _broken
from services.gateway.migration import Breakage, MigrationHistory, classify

S = grpc.StatusCode


def _error(code: grpc.StatusCode, failed: str | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(*(((FAILED_WORKER_KEY, failed),) if failed else ()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="boom")


@pytest.mark.parametrize("code", [S.UNAVAILABLE, S.ABORTED, S.CANCELLED])
def test_a_lost_decode_worker_is_blamed_and_the_request_moves(code) -> None:
    b = _broken(_error(code), "decode-1")
    assert b is not None and (b.breakage.cause, b.breakage.worker_id) == ("decode_lost", "decode-1")


@pytest.mark.parametrize("code", [S.INTERNAL, S.UNKNOWN])
def test_a_decode_worker_that_failed_the_request_is_not_taken_for_lost(code) -> None:
    b = classify(code, "boom", "decode-1", None)
    assert b is not None and (b.cause, b.worker_id, b.worker_lost) == (
        "decode_failed", "decode-1", False
    )  # fmt: skip


@pytest.mark.parametrize(
    ("code", "cause"),
    [(S.UNAVAILABLE, "prefill_lost"), (S.RESOURCE_EXHAUSTED, "prefill_lost"),
     (S.DEADLINE_EXCEEDED, "prefill_failed"), (S.INTERNAL, "prefill_failed"),
     (S.FAILED_PRECONDITION, "prefill_failed"), (S.PERMISSION_DENIED, "prefill_failed")],
)  # fmt: skip
def test_a_failed_prefill_blames_the_prefill_worker(code, cause) -> None:
    b = _broken(_error(code, failed="prefill-0"), "decode-1")
    assert b is not None and (b.breakage.cause, b.breakage.worker_id) == (cause, "prefill-0")


@pytest.mark.parametrize(
    ("code", "failed"),
    [(S.INVALID_ARGUMENT, None), (S.INVALID_ARGUMENT, "prefill-0"),
     (S.OUT_OF_RANGE, "prefill-0"), (S.RESOURCE_EXHAUSTED, None),
     (S.DEADLINE_EXCEEDED, None), (S.PERMISSION_DENIED, None)],
)  # fmt: skip
def test_the_request_at_fault_is_not_moved(code, failed) -> None:
    assert _broken(_error(code, failed), "decode-1") is None


def _b(cause: str, worker: str, code: grpc.StatusCode = S.INTERNAL) -> Breakage:
    return Breakage(cause, worker, code, "boom")


def test_a_request_that_fails_the_same_way_twice_stops_with_a_clear_error() -> None:
    """A prompt that outlasts the prefill deadline (or breaks whatever runs it) is tried on
    a second worker, not on four."""
    history = MigrationHistory(max_migrations=3)
    assert history.give_up(_b("prefill_failed", "prefill-0", S.DEADLINE_EXCEEDED)) is None
    reason = history.give_up(_b("prefill_failed", "prefill-1", S.DEADLINE_EXCEEDED))
    assert reason is not None
    assert "failed the same way on two workers" in reason
    assert "prefill_failed DEADLINE_EXCEEDED on prefill-0, prefill-1" in reason


def test_different_failures_and_lost_workers_use_the_migration_budget() -> None:
    history = MigrationHistory(max_migrations=3)
    assert history.give_up(_b("decode_lost", "decode-0", S.UNAVAILABLE)) is None
    assert history.give_up(_b("decode_lost", "decode-1", S.UNAVAILABLE)) is None  # kills
    assert history.give_up(_b("decode_failed", "decode-2")) is None  # one failure: moves
    reason = history.give_up(_b("prefill_lost", "prefill-0", S.UNAVAILABLE))
    assert reason is not None and reason.startswith("gave up after 3 migrations")
    assert MigrationHistory(max_migrations=0).give_up(_b("decode_lost", "d", S.UNAVAILABLE))

"""The tcp fence and the receiver's edges, with real sockets and threads in one process.

A failed job whose bytes went out is quiet only once the receiver answered its ABORT: by
then the receiver wrote every frame of it, so a block handed to another request keeps what
that request writes. The receiver bounds its connections, closes one that sends nothing, and
keeps accepting when a connection cannot get a thread.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

import transfer.tcp_receiver as tcp_receiver
from tests.transfer.target import (
    DST_LAYOUT,
    DST_SEED,
    LAYERS,
    MOVE_BYTES,
    MOVES,
    blocks_view,
    closed_by_peer,
    pattern,
    push_requests,
    source,
)
from transfer import TransferError
from transfer.tcp import TcpTransport
from transfer.tcp_frames import parse_address
from transfer.writer import DRAIN_TIMEOUT_S

pytestmark = pytest.mark.timeout(60)

A_SRC, A_DST = MOVES[0]


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``(held, release)``: the receiver stops before writing the first DATA payload it
    reads (``held`` is set) until ``release`` is set; later payloads pass. The bytes wait in
    the socket buffers meanwhile, as they do behind a slow receiver."""
    held, release = threading.Event(), threading.Event()
    real = tcp_receiver.recv_views

    def holding(sock: socket.socket, views: Sequence[memoryview], **kwargs: Any) -> bool:
        if not held.is_set():
            held.set()
            release.wait(30)
        return real(sock, views, **kwargs)

    monkeypatch.setattr(tcp_receiver, "recv_views", holding)
    yield held, release
    release.set()


def _kept_open(address: tuple[str, int], within: float = 0.3) -> bool:
    """A new connection that the receiver does not close within ``within`` seconds."""
    with socket.create_connection(address, timeout=within) as sock:
        try:
            return sock.recv(1) != b""
        except TimeoutError:
            return True
        except ConnectionResetError:
            return False


def test_late_bytes_of_an_aborted_job_never_land_in_reused_blocks(
    hold: tuple[threading.Event, threading.Event],
) -> None:
    held, release = hold
    with TcpTransport() as target, TcpTransport() as initiator:
        region = target.register(DST_LAYOUT)
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
        blocks = blocks_view(region.tensor, DST_LAYOUT)
        b_pattern = pattern(blocks[:, :, A_DST].numel(), seed=13).view_as(blocks[:, :, A_DST])
        writer = initiator.connect(region.handle, source())
        a = writer.begin("a", A_SRC, A_DST, deadline=time.monotonic() + 10)
        reused = threading.Event()

        def decode_worker() -> None:
            """Hands A's blocks to request B the moment A's fence holds."""
            a.outcome.exception(10)
            if a.quiet:
                blocks[:, :, A_DST] = b_pattern  # what B's prefill writes into them
                reused.set()

        worker = threading.Thread(target=decode_worker)
        worker.start()
        try:
            for layer in range(DST_LAYOUT.num_layers):
                a.write_layer(layer)
            assert held.wait(5), "A's first frame never reached the receiver"
            a.abort("cancelled")
            # A's frames sit in the receiver's socket buffer: the fence must not hold yet.
            reused_while_held = reused.wait(0.5)
        finally:
            release.set()
        # Frames of one connection are handled in order: once a later job is confirmed, the
        # receiver has handled every frame of A (and its ABORT).
        assert [r.bytes for r in push_requests(writer, moves=MOVES[1:])] == MOVE_BYTES[1:]
        worker.join(10)
        assert not worker.is_alive()
        assert a.outcome.done() and a.quiet, "A's drop was never confirmed"
        assert torch.equal(blocks[:, :, A_DST], b_pattern), "a byte of A landed after the fence"
        assert not reused_while_held


def test_a_drain_the_receiver_never_answers_is_given_up_and_not_quiet(
    hold: tuple[threading.Event, threading.Event],
) -> None:
    held, release = hold
    with TcpTransport() as target, TcpTransport() as initiator:
        region = target.register(DST_LAYOUT)
        writer = initiator.connect(region.handle, source())
        sock = writer._conn.sock  # type: ignore[attr-defined]
        try:
            a = writer.begin("a", A_SRC, A_DST, deadline=time.monotonic() + 30)
            for layer in LAYERS:
                a.write_layer(layer)
            assert held.wait(5)
            started = time.monotonic()
            a.abort("cancelled")
            with pytest.raises(TransferError, match="'a' cancelled"):
                a.outcome.result(DRAIN_TIMEOUT_S + 5)
            elapsed = time.monotonic() - started
            assert not a.quiet
            assert DRAIN_TIMEOUT_S - 0.05 <= elapsed < DRAIN_TIMEOUT_S + 1.0
            assert sock.fileno() == -1  # the writer closed the connection it gave up on
        finally:
            release.set()
        # The next job dials a new connection and lands.
        assert [r.bytes for r in push_requests(writer, moves=MOVES[1:])] == MOVE_BYTES[1:]


def test_connections_over_the_cap_are_closed_at_once() -> None:
    with TcpTransport(max_connections=2) as target, TcpTransport() as initiator:
        region = target.register(DST_LAYOUT)
        address = parse_address(region.handle.address)
        writer = initiator.connect(region.handle, source())  # the first connection
        # A silent second one fills the cap; a third is one too many.
        with socket.create_connection(address), socket.create_connection(address) as extra:
            started = time.monotonic()
            assert closed_by_peer(extra)
            assert time.monotonic() - started < 1.0
            assert target.rejected_connections == 1
            # The writer's connection, within the cap, is served.
            assert [r.bytes for r in push_requests(writer)] == MOVE_BYTES
        # A connection that ends frees its slot.
        deadline = time.monotonic() + 5
        while not _kept_open(address):
            assert time.monotonic() < deadline, "the closed connection's slot never freed"


def test_a_connection_that_sends_nothing_is_closed_after_io_timeout() -> None:
    with TcpTransport(io_timeout=0.3, idle_timeout=30.0) as target:
        region = target.register(DST_LAYOUT)
        with socket.create_connection(parse_address(region.handle.address)) as silent:
            started = time.monotonic()
            assert closed_by_peer(silent)
            assert 0.25 <= time.monotonic() - started < 2.0


def test_a_thread_that_cannot_start_costs_one_connection_not_the_acceptor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with TcpTransport(max_connections=1) as target, TcpTransport() as initiator:
        region = target.register(DST_LAYOUT)
        real_start = threading.Thread.start
        refused: list[threading.Thread] = []

        def start(thread: threading.Thread) -> None:
            if thread.name == "kv-recv" and not refused:
                refused.append(thread)
                raise RuntimeError("can't start new thread")
            real_start(thread)

        monkeypatch.setattr(tcp_receiver.threading.Thread, "start", start)
        with socket.create_connection(parse_address(region.handle.address)) as doomed:
            assert closed_by_peer(doomed)
        assert refused and target.rejected_connections == 1
        assert target.healthy
        # The acceptor goes on, and the failed connection gave its slot (the only one) back.
        results = push_requests(initiator.connect(region.handle, source()))
        assert [r.bytes for r in results] == MOVE_BYTES


def test_a_receiver_whose_acceptor_died_is_not_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    with TcpTransport() as target:
        assert target.healthy  # nothing registered yet: nothing to serve
        region = target.register(DST_LAYOUT)
        assert target.healthy

        def broken(*args: object) -> None:
            raise ValueError("a bug")

        monkeypatch.setattr(tcp_receiver, "tune_socket", broken)
        address = parse_address(region.handle.address)
        with socket.create_connection(address) as sock:
            assert closed_by_peer(sock)
        deadline = time.monotonic() + 5
        while target.healthy:
            assert time.monotonic() < deadline, "the acceptor did not stop"
            time.sleep(0.01)
        with pytest.raises(ConnectionRefusedError):  # nobody would accept it: refused now
            socket.create_connection(address, timeout=2).close()

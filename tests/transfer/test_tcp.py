"""The tcp transport: a receiver thread in a target process writes frames into its pool."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch

from tests.transfer.target import (
    DST_LAYOUT,
    DST_SEED,
    LAYERS,
    MOVE_BYTES,
    MOVES,
    SRC_LAYOUT,
    Target,
    assert_pushed,
    blocks_view,
    closed_by_peer,
    expected_pool,
    pattern,
    push_requests,
    source,
    wait_until,
)
from transfer import KVLayout, MemoryRegionHandle, TransferError, TransferTimeout
from transfer.tcp import TcpTransport, TcpWork
from transfer.tcp_frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    AckStatus,
    Frame,
    FrameKind,
    encode_data,
    parse_address,
)
from transfer.writer import DRAIN_TIMEOUT_S

pytestmark = pytest.mark.timeout(60)


def test_writes_land_exactly_in_a_target_process() -> None:
    with TcpTransport() as transport, Target("tcp", DST_LAYOUT) as target:
        src = source()
        writer = transport.connect(target.handle, src)
        assert transport.connect(target.handle, src) is writer  # cached per region and source
        assert_pushed(writer, target, push_requests(writer))
        seen = target.stats()
        assert (seen.bytes, seen.jobs, seen.failures) == (sum(MOVE_BYTES), 2, 0)

        target.close()  # the process exits: nobody listens any more
        started = time.monotonic()
        with pytest.raises(TransferError, match=r"lost|cannot connect"):
            push_requests(writer)
        assert time.monotonic() - started < 2.0


def test_target_that_stops_reading_times_out_drains_then_the_writer_recovers() -> None:
    with TcpTransport() as transport, Target("tcp", DST_LAYOUT) as target:
        writer = transport.connect(target.handle, source())
        sock = writer._conn.sock  # type: ignore[attr-defined]
        target.pause()  # SIGSTOP: frames sit in socket buffers, no ack ever comes
        started = time.monotonic()
        try:
            job = writer.begin("req-0", *MOVES[0], deadline=started + 1.0)
            for layer in LAYERS:
                job.write_layer(layer)
            job.finish()
            assert wait_until(lambda: writer.stats().failures == 1, 5)
            elapsed = time.monotonic() - started
            # Its frames may still land: the outcome waits for the receiver's word on them.
            assert not job.outcome.done()
        finally:
            target.resume()
        assert 0.95 <= elapsed < 1.5
        with pytest.raises(TransferTimeout, match="awaiting confirmation"):
            job.outcome.result(DRAIN_TIMEOUT_S)
        assert job.quiet  # the receiver answered the ABORT: it handled every frame before it
        # The buffered bytes landed before that answer, as the fence needs.
        assert target.verify(SRC_LAYOUT, MOVES[:1], LAYERS) == 0
        # Same request id again, same connection: the late ACK of the failed job's END was
        # not taken for a success, and must not be taken for this one's.
        results = push_requests(writer, moves=MOVES[1:])
        assert [r.bytes for r in results] == MOVE_BYTES[1:]
        assert writer._conn.sock is sock  # type: ignore[attr-defined]
        assert target.verify(SRC_LAYOUT, MOVES, LAYERS) == 0


def test_target_killed_mid_transfer_fails_fast_not_by_timeout() -> None:
    with TcpTransport() as transport, Target("tcp", DST_LAYOUT) as target:
        writer = transport.connect(target.handle, source())
        job = writer.begin("req", [0, 1], [2, 3], deadline=time.monotonic() + 10)
        job.write_layer(0)
        job.write_layer(1)
        target.kill()
        started = time.monotonic()
        job.write_layer(2)
        with pytest.raises(TransferError, match=r"lost|failed") as failure:
            job.finish().result(10)
        assert not isinstance(failure.value, TransferTimeout)
        assert time.monotonic() - started < 2.0
        assert writer.stats().failures == 1


def test_bad_frames_close_only_their_connection() -> None:
    with TcpTransport() as transport:
        region = transport.register(DST_LAYOUT)
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
        before = region.tensor.clone()
        host, port = parse_address(region.handle.address)
        key = bytes.fromhex(region.handle.key)
        length = region.handle.length
        silent = socket.create_connection((host, port))  # holds a connection open meanwhile
        garbage = [
            encode_data(b"\x01" * 16, 1, [(0, 64)], 64) + b"\xff" * 64,
            encode_data(key, 1, [(length - 8, 64)], 64) + b"\xff" * 64,
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(48, b"x"),
            Frame(FrameKind.ACK, key, 1).encode(),
        ]
        for count, data in enumerate(garbage, start=1):
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(data)
                assert closed_by_peer(sock)
            assert wait_until(lambda n=count: transport.rejected_connections == n, 2)
        # A writer holding a handle with the wrong key cannot write either.
        forged = dataclasses.replace(region.handle, key="00" * 16, region_id="forged")
        with pytest.raises(TransferError, match="lost"):
            push_requests(transport.connect(forged, source()))
        assert torch.equal(region.tensor, before)
        assert transport.rejected_connections == len(garbage) + 1

        results = push_requests(transport.connect(region.handle, source()))
        assert [r.bytes for r in results] == MOVE_BYTES
        assert torch.equal(region.tensor, expected_pool(DST_LAYOUT, SRC_LAYOUT, MOVES, LAYERS))
        silent.close()


def test_malformed_and_truncated_frames_are_rejected_with_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with TcpTransport() as transport:
        region = transport.register(DST_LAYOUT)
        region.tensor.copy_(pattern(DST_LAYOUT.total_bytes, DST_SEED))
        before = region.tensor.clone()
        host, port = parse_address(region.handle.address)
        key = bytes.fromhex(region.handle.key)
        length = region.handle.length
        v1 = HEADER.pack(MAGIC, 1, FrameKind.DATA, 0, key, 1, 0, 64)  # the old format
        listing = encode_data(key, 1, [(0, 32), (64, 32)], 64)
        bad = [
            (v1 + b"\xff" * 64, "unsupported frame version 1"),
            # The lengths in the list do not add up to the header's length.
            (encode_data(key, 1, [(0, 32), (64, 32)], 100) + b"\xff" * 100, "add up to 64"),
            # One range of two runs past the region's end: nothing of the frame lands.
            (encode_data(key, 1, [(0, 32), (length - 8, 32)], 64) + b"\xff" * 64, "outside"),
            # Cut short: in the range list, in the payload.
            (listing[: HEADER_SIZE + 8], "truncated frame: in the range list"),
            (listing + b"\xff" * 40, "truncated frame: in the payload"),
        ]
        for count, (data, reason) in enumerate(bad, start=1):
            caplog.clear()
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(data)
                if "truncated" in reason:
                    sock.shutdown(socket.SHUT_WR)  # the writer died mid-frame
                assert closed_by_peer(sock)
            assert wait_until(lambda n=count: transport.rejected_connections == n, 2)
            assert reason in caplog.text
        # Only the truncated payload's 40 bytes landed, scattered as its list said: 32 at 0,
        # 8 at 64 (a failed job's bytes may land; its blocks stay leased). Nothing else did.
        landed = torch.zeros_like(region.tensor, dtype=torch.bool)
        landed[0:32] = landed[64:72] = True
        assert torch.equal(region.tensor[~landed], before[~landed])
        assert bool((region.tensor[landed] == 0xFF).all())
        # Every rejection but the first names the region's key: its failures count them.
        assert region.stats().failures == len(bad) - 1
        region.tensor[landed] = before[landed]
        results = push_requests(transport.connect(region.handle, source()))
        assert [r.bytes for r in results] == MOVE_BYTES
        assert torch.equal(region.tensor, expected_pool(DST_LAYOUT, SRC_LAYOUT, MOVES, LAYERS))


def test_receiver_drops_clients_that_go_silent() -> None:
    with TcpTransport(io_timeout=0.3, idle_timeout=0.5) as transport:
        region = transport.register(DST_LAYOUT)
        host, port = parse_address(region.handle.address)
        key = bytes.fromhex(region.handle.key)
        with socket.create_connection((host, port)) as stalled:
            stalled.sendall(encode_data(key, 1, [(0, 1000)], 1000) + b"x" * 10)
            started = time.monotonic()
            assert closed_by_peer(stalled)  # mid-frame silence: io_timeout
            assert 0.25 <= time.monotonic() - started < 2.0
        with socket.create_connection((host, port)) as idle:
            idle.sendall(Frame(FrameKind.ABORT, key, 1).encode())  # a first frame, answered
            idle.settimeout(5)
            ack = Frame.decode(idle.recv(HEADER_SIZE, socket.MSG_WAITALL))
            assert (ack.kind, ack.tag, ack.status) == (FrameKind.ACK, 1, AckStatus.DROPPED)
            started = time.monotonic()
            assert closed_by_peer(idle)  # between frames: idle_timeout
            assert 0.45 <= time.monotonic() - started < 2.0
        # A writer whose idle connection was closed reconnects on its next job.
        writer = transport.connect(region.handle, source())
        time.sleep(0.8)
        results = push_requests(writer)
        assert [r.bytes for r in results] == MOVE_BYTES


def test_large_ranges_arrive_intact() -> None:
    layout = KVLayout(
        num_layers=2, num_blocks=4, block_size=64, num_kv_heads=8, head_dim=128, dtype="float32"
    )  # 256 KiB blocks: a 3-block run is a 768 KiB frame, larger than one recv
    src = source(layout)
    with TcpTransport() as target_side, TcpTransport() as initiator:
        region = target_side.register(layout)
        writer = initiator.connect(region.handle, src)
        job = writer.begin("big", [0, 1, 2, 3], [1, 2, 3, 0], deadline=time.monotonic() + 10)
        for layer in range(layout.num_layers):
            job.write_layer(layer)
        assert job.finish().result(10).bytes == layout.total_bytes
        got, want = blocks_view(region.tensor, layout), blocks_view(src.tensor, layout)
        assert torch.equal(got[:, :, [1, 2, 3, 0]], want)


def test_unreachable_target_fails_connect_quickly() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before anyone dials it
    handle = MemoryRegionHandle(
        "tcp", f"127.0.0.1:{port}", DST_LAYOUT.total_bytes, "ab" * 16, DST_LAYOUT, "gone"
    )
    with TcpTransport() as transport:
        started = time.monotonic()
        with pytest.raises(TransferError, match="cannot connect"):
            transport.connect(handle, source())
        assert time.monotonic() - started < 2.0
        with pytest.raises(TransferError, match="32 hex digits"):
            transport.connect(dataclasses.replace(handle, key="nothex"), source())
        with pytest.raises(TransferError, match="host:port"):
            transport.connect(dataclasses.replace(handle, address="localhost"), source())


def test_an_ack_that_does_not_match_what_was_sent_fails_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with TcpTransport() as transport:
        region = transport.register(DST_LAYOUT)
        writer = transport.connect(region.handle, source())
        job = writer.begin("req", *MOVES[0], deadline=time.monotonic() + 10)
        for layer in LAYERS:
            job.write_layer(layer)
        # The receiver counts what it received; an END declaring more must not pass.
        real_end = writer._end  # type: ignore[attr-defined]

        def inflated(work: TcpWork) -> None:
            work.framed += 1
            real_end(work)

        monkeypatch.setattr(writer, "_end", inflated)
        with pytest.raises(TransferError, match=r"receiver got \d+ bytes of 'req', \d+ were sent"):
            job.finish().result(10)
        assert region.stats().failures == 1

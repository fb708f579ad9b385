"""The tcp wire format (version 3) and its socket loops, over real socket pairs."""

from __future__ import annotations

import itertools
import socket
import struct
import threading
import time

import pytest

from transfer import TransferError, TransferTimeout
from transfer.tcp_frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_RANGES,
    VERSION,
    AckStatus,
    Frame,
    FrameError,
    FrameKind,
    PeerClosed,
    decode_ranges,
    encode_data,
    recv_views,
    send_views,
    set_io_tick,
    split_frames,
)

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(16))


def _header(version: int = VERSION, kind: int = FrameKind.DATA, count: int = 1) -> bytes:
    return HEADER.pack(MAGIC, version, kind, 0, KEY, 7, count, 64)


def test_frames_round_trip() -> None:
    end = Frame(FrameKind.END, KEY, tag=3, length=1 << 40)
    assert Frame.decode(end.encode()) == end
    ack = Frame(FrameKind.ACK, KEY, tag=2**64 - 1, length=5, status=AckStatus.MISMATCH)
    assert Frame.decode(ack.encode()) == ack
    dropped = Frame(FrameKind.ACK, KEY, tag=4, length=64, status=AckStatus.DROPPED)
    assert Frame.decode(dropped.encode()).status == AckStatus.DROPPED
    data = encode_data(KEY, 9, [(4096, 100), (0, 28)], 128)
    assert len(data) == HEADER_SIZE + 2 * 16
    frame = Frame.decode(data[:HEADER_SIZE])
    assert (frame.kind, frame.tag, frame.count, frame.length) == (FrameKind.DATA, 9, 2, 128)
    assert decode_ranges(data[HEADER_SIZE:], frame, region_length=1 << 20) == [
        (4096, 100),
        (0, 28),
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"HTTP" + _header()[4:], "bad frame magic"),
        (_header(version=1), "unsupported frame version 1"),
        (_header(version=2), "unsupported frame version 2"),  # ABORT went unanswered
        (_header(kind=9), "unknown frame kind 9"),
        (_header(count=0), "DATA frame with 0 ranges"),
        (_header(count=MAX_RANGES + 1), f"DATA frame with {MAX_RANGES + 1} ranges"),
        (_header(kind=FrameKind.END, count=2), "END frame with a range count"),
    ],
)
def test_malformed_headers_are_rejected_with_the_reason(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        Frame.decode(raw)


@pytest.mark.parametrize(
    ("ranges", "length", "message"),
    [
        ([(0, 64), (64, 0)], 64, "empty or outside"),
        ([(1000, 25)], 25, r"\[1000, 1025\) empty or outside the 1024-byte region"),
        ([(2**64 - 8, 16)], 16, "empty or outside"),  # offset + length would wrap
        ([(0, 10), (20, 10)], 30, "add up to 20 bytes, the header says 30"),
    ],
)
def test_bad_range_lists_are_rejected(ranges: list, length: int, message: str) -> None:
    flat = [v for pair in ranges for v in pair]
    listing = struct.pack(f"!{len(flat)}Q", *flat)
    frame = Frame(FrameKind.DATA, KEY, 1, count=len(ranges), length=length)
    with pytest.raises(FrameError, match=message):
        decode_ranges(listing, frame, region_length=1024)


def test_encode_data_refuses_what_a_receiver_would_reject() -> None:
    with pytest.raises(TransferError, match="1 to 512 ranges"):
        encode_data(KEY, 1, [], 0)
    with pytest.raises(TransferError, match="1 to 512 ranges"):
        encode_data(KEY, 1, [(0, 1)] * (MAX_RANGES + 1), MAX_RANGES + 1)


def test_split_frames_by_bytes_and_by_count() -> None:
    assert split_frames([], 4, 100) == []
    assert split_frames([40, 40, 40, 40], 8, 100) == [(0, 2, 80), (2, 4, 80)]
    assert split_frames([10] * 5, 2, 1000) == [(0, 2, 20), (2, 4, 20), (4, 5, 10)]
    # A range larger than the byte cap travels alone; it is never cut.
    assert split_frames([10, 500, 10], 8, 100) == [(0, 1, 10), (1, 2, 500), (2, 3, 10)]
    spans = split_frames(list(range(1, 200)), 16, 300)
    assert [s for s, _, _ in spans[1:]] == [e for _, e, _ in spans[:-1]]  # contiguous
    assert sum(size for _, _, size in spans) == sum(range(1, 200))


def _pair(tick: float = 0.05) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for sock in (a, b):
        set_io_tick(sock, tick, tick)
    return a, b


def test_views_scatter_and_gather_without_joining() -> None:
    a, b = _pair()
    with a, b:
        payload = bytes(range(256)) * 4000  # ~1 MB: more than one socket buffer
        parts = [memoryview(payload)[i : i + 1000] for i in range(0, len(payload), 1000)]
        sender = threading.Thread(
            target=send_views, args=(a, parts), kwargs={"give_up": lambda: None}
        )
        sender.start()
        out = bytearray(len(payload))
        view = memoryview(out)
        # Uneven destination pieces, in another order than the sender's.
        cuts = [0, 7, 7, 70_001, 500_000, len(payload)]
        pieces = [view[x:y] for x, y in itertools.pairwise(cuts)]
        assert recv_views(b, pieces, inactivity=5.0, stop=lambda: False)
        sender.join(10)
        assert bytes(out) == payload


def test_recv_views_fails_on_eof_silence_and_stop() -> None:
    a, b = _pair()
    with a, b:
        a.sendall(b"abc")
        a.shutdown(socket.SHUT_WR)
        buf = memoryview(bytearray(10))
        with pytest.raises(PeerClosed, match="after 3 of 10 bytes"):
            recv_views(b, [buf[:4], buf[4:]], inactivity=5.0, stop=lambda: False)
    a, b = _pair()
    with a, b:
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match="no data"):
            recv_views(b, [buf], inactivity=0.2, stop=lambda: False)
        assert 0.15 <= time.monotonic() - started < 2.0
        with pytest.raises(TransferError, match="stopped"):
            recv_views(b, [buf], inactivity=60.0, stop=lambda: True)
        a.close()
        assert recv_views(b, [buf], inactivity=5.0, stop=lambda: False, eof_ok=True) is False


def test_send_views_gives_up_when_told() -> None:
    a, b = _pair(tick=0.05)
    with a, b:
        deadline = time.monotonic() + 0.3

        def give_up() -> None:
            if time.monotonic() > deadline:
                raise TransferTimeout("deadline")

        big = memoryview(bytes(64 << 20))  # nobody reads: the buffers fill, then it waits
        started = time.monotonic()
        with pytest.raises(TransferTimeout):
            send_views(a, [big], give_up=give_up)
        assert time.monotonic() - started < 2.0

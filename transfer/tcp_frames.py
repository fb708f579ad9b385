"""Wire format of the ``tcp`` transport, and socket loops that never block forever.

Every frame starts with one fixed 48-byte header (network byte order)::

    magic "PDKV" | version u8 | kind u8 | status u16 | key 16 bytes | job tag u64
    | count u64 | length u64

- DATA (writer -> receiver): ``count`` ranges (1 to ``MAX_RANGES``) carrying ``length``
  payload bytes in all. The header is followed by the range list, ``count`` pairs of
  (region offset u64, byte count u64), then the ranges' payloads back to back in list order.
  A writer packs a job's ranges (of one or several layers) into frames of about
  ``FRAME_BYTES``.
- END (writer -> receiver): the job is complete; ``length`` is the byte count the writer sent.
- ABORT (writer -> receiver): forget the job's partial count, and answer.
- ACK (receiver -> writer): ``length`` is the job's bytes seen; ``status`` OK or MISMATCH
  answers END, DROPPED answers ABORT: every earlier frame of the job on this connection was
  handled, so none of its bytes can land any more (the writer's fence waits for it).

``count`` is 0 in every frame but DATA. A frame that breaks any of these rules (wrong magic,
another version, unknown kind, a count out of bounds, a range list whose lengths do not add
up to ``length``, an empty or out-of-region range) is rejected: the receiver closes that
connection. Older versions are not spoken and are rejected ("unsupported frame version N"):
1 had one range per DATA frame; 2 left ABORT unanswered (a version-3 writer waiting for
the answer would give up each drain and close the connection, failing the other jobs on
it: a mixed pair fails at its first frame instead).

``key`` is the region's secret from its handle (a stray client cannot write into memory);
the job tag is unique per job on one connection (the writer counts them).

The receiver's sockets stay in blocking mode (no Python-level timeout, so no ``poll`` before
each call); a kernel timeout (``SO_RCVTIMEO`` / ``SO_SNDTIMEO``, see ``set_io_tick``) makes a
call that waits longer than one tick return, so the loops below check a stop flag, a
deadline or an inactivity limit between calls without costing anything while bytes flow.
(The writer's socket is non-blocking, on its owner thread's selector: ``transfer/tcp.py``.)
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import NamedTuple

from transfer.errors import TransferError, TransferTimeout

TRANSPORT_NAME = "tcp"
MAGIC = b"PDKV"
VERSION = 3
HEADER = struct.Struct("!4sBBH16sQQQ")
HEADER_SIZE = HEADER.size
RANGE = struct.Struct("!QQ")
KEY_BYTES = 16
# Ranges per DATA frame: bounds the range list a receiver reads before checking it, and
# keeps one frame's buffers within one sendmsg/recvmsg (IOV_MAX is 1024 on Linux).
MAX_RANGES = 512
IOV_MAX = 1024
# How long one blocked socket call waits before its loop checks stop flags and deadlines.
POLL_SECONDS = 0.05
# A writer cuts a job's ranges into frames of about this many bytes (a range is never
# split): big enough to amortize a frame's work, small enough that the two ends' per-frame
# work overlaps the bytes in flight (docs/benchmarks.md, transfer).
FRAME_BYTES = 1 << 20


class FrameKind(IntEnum):
    DATA = 1
    END = 2
    ABORT = 3
    ACK = 4


_KINDS = {kind.value: kind for kind in FrameKind}


class AckStatus(IntEnum):
    OK = 0  # END: the byte count matches
    MISMATCH = 1  # END: it does not
    DROPPED = 2  # ABORT: the job's frames before it were all handled


class FrameError(TransferError):
    """A frame that is not ours, not this version, or not well formed."""


class PeerClosed(TransferError):
    """The peer closed the connection in the middle of a message."""


class Frame(NamedTuple):
    """One frame's header. A named tuple: every frame makes one on both ends, and a tuple
    is several times cheaper to build than a frozen dataclass."""

    kind: FrameKind
    key: bytes
    tag: int
    count: int = 0
    length: int = 0
    status: int = 0

    def encode(self) -> bytes:
        return HEADER.pack(
            MAGIC, VERSION, self.kind, self.status, self.key, self.tag, self.count, self.length
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Frame:
        magic, version, kind, status, key, tag, count, length = HEADER.unpack(data)
        if magic != MAGIC:
            raise FrameError(f"bad frame magic {bytes(magic)!r}")
        if version != VERSION:
            raise FrameError(f"unsupported frame version {version} (this side speaks {VERSION})")
        frame_kind = _KINDS.get(kind)
        if frame_kind is None:
            raise FrameError(f"unknown frame kind {kind}")
        if frame_kind is FrameKind.DATA:
            if not 1 <= count <= MAX_RANGES:
                raise FrameError(f"DATA frame with {count} ranges (1 to {MAX_RANGES} allowed)")
        elif count:
            raise FrameError(f"{frame_kind.name} frame with a range count ({count})")
        return cls(frame_kind, key, tag, count, length, status)


def encode_data(key: bytes, tag: int, ranges: Sequence[tuple[int, int]], length: int) -> bytes:
    """Header and range list of a DATA frame; ``ranges`` are (region offset, byte count)."""
    if not 1 <= len(ranges) <= MAX_RANGES:
        raise TransferError(f"a DATA frame carries 1 to {MAX_RANGES} ranges, not {len(ranges)}")
    flat = [v for pair in ranges for v in pair]
    head = HEADER.pack(MAGIC, VERSION, FrameKind.DATA, 0, key, tag, len(ranges), length)
    return head + struct.pack(f"!{len(flat)}Q", *flat)


def split_frames(
    lengths: Sequence[int], max_ranges: int, max_bytes: int
) -> list[tuple[int, int, int]]:
    """Cut a write's ranges (their ``lengths``) into frames: ``(start, stop, bytes)`` index
    spans of at most ``max_ranges`` ranges and, unless one range alone is larger, at most
    ``max_bytes`` bytes."""
    frames: list[tuple[int, int, int]] = []
    start, size = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start >= max_ranges or size + n > max_bytes):
            frames.append((start, i, size))
            start, size = i, 0
        size += n
    if start < len(lengths):
        frames.append((start, len(lengths), size))
    return frames


def decode_ranges(
    data: bytes | bytearray | memoryview, frame: Frame, region_length: int
) -> list[tuple[int, int]]:
    """The range list of DATA ``frame`` as ``(offset, length)`` pairs, checked against a
    region of ``region_length`` bytes; ``FrameError`` names the first bad range."""
    values = struct.unpack(f"!{2 * frame.count}Q", data)
    ranges = list(zip(values[::2], values[1::2], strict=True))
    total = 0
    for offset, length in ranges:
        if length == 0 or offset > region_length or length > region_length - offset:
            raise FrameError(
                f"DATA range [{offset}, {offset + length}) empty or outside the "
                f"{region_length}-byte region"
            )
        total += length
    if total != frame.length:
        raise FrameError(f"DATA ranges add up to {total} bytes, the header says {frame.length}")
    return ranges


def key_bytes(key: str) -> bytes:
    """The 16 raw bytes of a handle's hex key; ``TransferError`` if it is not one."""
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) != KEY_BYTES:
        raise TransferError(f"tcp handle key must be {2 * KEY_BYTES} hex digits")
    return raw


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6 host]:port`` -> (host, port); ``TransferError`` if malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"tcp address must be host:port, got {address!r}")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def set_io_tick(sock: socket.socket, send: float, recv: float) -> None:
    """Blocking mode, with kernel send/receive timeouts (the loops' ticks), in seconds."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv))


def advance(views: list[memoryview], count: int) -> list[memoryview]:
    """``views`` without their first ``count`` bytes."""
    i = 0
    while i < len(views) and count >= len(views[i]):
        count -= len(views[i])
        i += 1
    rest = views[i:]
    if count:
        rest[0] = rest[0][count:]
    return rest


def recv_views(
    sock: socket.socket,
    views: Sequence[memoryview],
    *,
    inactivity: float,
    stop: Callable[[], bool],
    eof_ok: bool = False,
) -> bool:
    """Fill ``views`` in order from ``sock``, straight into their memory (no copy).

    One ``recvmsg_into`` (``recv_into`` for one view) with ``MSGsocket.MSG_WAITALL`` per call: while
    bytes flow, one system call fills all views. Returns False on a clean EOF before the
    first byte when ``eof_ok``; raises ``PeerClosed`` on EOF mid-way, ``TransferError`` when
    ``stop()`` turns true, ``TransferTimeout`` after ``inactivity`` seconds without a byte.
    """
    pending = [v for v in views if len(v)]
    total = sum(len(v) for v in pending)
    got = 0
    last = time.monotonic()
    while pending:
        if stop():
            raise TransferError("stopped")
        try:
            if len(pending) == 1:
                count = sock.recv_into(pending[0], len(pending[0]), socket.MSG_WAITALL)
            else:
                count = sock.recvmsg_into(pending[:IOV_MAX], 0, socket.MSG_WAITALL)[0]
        except (BlockingIOError, TimeoutError):  # one tick without a byte
            if time.monotonic() - last > inactivity:
                raise TransferTimeout(f"no data for {inactivity:.1f} s") from None
            continue
        if count == 0:
            if got == 0 and eof_ok:
                return False
            raise PeerClosed(f"peer closed the connection after {got} of {total} bytes")
        got += count
        last = time.monotonic()
        pending = advance(pending, count)
    return True


def recv_exactly(
    sock: socket.socket,
    view: memoryview,
    *,
    inactivity: float,
    stop: Callable[[], bool],
    eof_ok: bool = False,
) -> bool:
    """``recv_views`` of one buffer."""
    return recv_views(sock, [view], inactivity=inactivity, stop=stop, eof_ok=eof_ok)


def send_views(
    sock: socket.socket,
    views: Sequence[memoryview | bytes],
    *,
    give_up: Callable[[], None],
) -> None:
    """Send all of ``views`` in order with ``sendmsg`` (gather: no joined copy).

    ``give_up()`` runs before each call and raises to stop; a call that cannot make
    progress returns after one tick of the socket's send timeout.
    """
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    while pending:
        give_up()
        try:
            sent = sock.sendmsg(pending[:IOV_MAX])
        except (BlockingIOError, TimeoutError):  # one tick without room in the buffer
            continue
        pending = advance(pending, sent)


def send_exactly(
    sock: socket.socket, data: memoryview | bytes, *, give_up: Callable[[], None]
) -> None:
    """``send_views`` of one buffer."""
    send_views(sock, [data], give_up=give_up)

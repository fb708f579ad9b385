"""Wire format of the ``tcp`` transport, and socket loops that never block forever.

Every frame starts with one fixed 48-byte header (network byte order)::

    magic "PDKV" | version u8 | kind u8 | status u16 | key 16 bytes | job tag u64
    | offset u64 | length u64

- DATA (writer -> receiver): ``length`` payload bytes follow, to land at region ``offset``.
- END (writer -> receiver): the job is complete; ``length`` is the byte count the writer sent.
- ABORT (writer -> receiver): forget the job's partial count.
- ACK (receiver -> writer): answer to END; ``status`` OK or MISMATCH, ``length`` bytes seen.

``key`` is the region's secret from its handle (a stray client cannot write into memory);
the job tag is unique per job on one connection (the writer counts them). Sockets run with
a short timeout so the loops below can check a stop flag, a deadline or an inactivity limit
between calls.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from socket import socket

from transfer.errors import TransferError, TransferTimeout

TRANSPORT_NAME = "tcp"
MAGIC = b"PDKV"
VERSION = 1
HEADER = struct.Struct("!4sBBH16sQQQ")
HEADER_SIZE = HEADER.size
KEY_BYTES = 16
# Socket timeout: how often blocked loops wake to check their stop condition.
POLL_SECONDS = 0.05


class FrameKind(IntEnum):
    DATA = 1
    END = 2
    ABORT = 3
    ACK = 4


class AckStatus(IntEnum):
    OK = 0
    MISMATCH = 1


class FrameError(TransferError):
    """A frame header that is not ours or not this version."""


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    key: bytes
    tag: int
    offset: int = 0
    length: int = 0
    status: int = 0

    def encode(self) -> bytes:
        return HEADER.pack(
            MAGIC, VERSION, self.kind, self.status, self.key, self.tag, self.offset, self.length
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Frame:
        magic, version, kind, status, key, tag, offset, length = HEADER.unpack(data)
        if magic != MAGIC:
            raise FrameError(f"bad frame magic {bytes(magic)!r}")
        if version != VERSION:
            raise FrameError(f"unsupported frame version {version}")
        try:
            frame_kind = FrameKind(kind)
        except ValueError:
            raise FrameError(f"unknown frame kind {kind}") from None
        return cls(frame_kind, key, tag, offset, length, status)


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


def recv_exactly(
    sock: socket,
    view: memoryview,
    *,
    inactivity: float,
    stop: Callable[[], bool],
    eof_ok: bool = False,
) -> bool:
    """Fill ``view`` from ``sock`` (``recv_into`` straight into it, no copy).

    Returns False on a clean EOF before the first byte when ``eof_ok``; raises
    ``TransferError`` on EOF mid-way or when ``stop()`` turns true, ``TransferTimeout`` after
    ``inactivity`` seconds without a byte.
    """
    total, got = len(view), 0
    last = time.monotonic()
    while got < total:
        if stop():
            raise TransferError("stopped")
        try:
            count = sock.recv_into(view[got:], total - got)
        except TimeoutError:
            if time.monotonic() - last > inactivity:
                raise TransferTimeout(f"no data for {inactivity:.1f} s") from None
            continue
        if count == 0:
            if got == 0 and eof_ok:
                return False
            raise TransferError(f"peer closed the connection after {got} of {total} bytes")
        got += count
        last = time.monotonic()
    return True


def send_exactly(sock: socket, view: memoryview | bytes, *, give_up: Callable[[], None]) -> None:
    """Send all of ``view``; ``give_up()`` runs between attempts and raises to stop."""
    data = memoryview(view)
    sent, total = 0, len(data)
    while sent < total:
        give_up()
        try:
            sent += sock.send(data[sent:])
        except TimeoutError:
            continue

"""Target side of the ``tcp`` transport: a listener whose threads write frames into regions.

``TcpReceiver`` owns one listening socket; each accepted connection gets a handler thread
that reads a frame header, checks the region key, reads and checks the DATA frame's range
list, then receives the payloads with one ``recvmsg_into`` straight into the memoryview
slices of the region's tensor that the ranges name (no intermediate copy). A bad frame
(unknown key, garbage, another version, a malformed range list, out-of-bounds range, wrong
direction) or a frame cut short by the peer closes that connection only and counts in
``rejected``; every read has an inactivity timeout (``idle_timeout`` between frames,
``io_timeout`` inside one and before a connection's first), so no thread waits forever.
At most ``max_connections`` are served at once; one more, or one no thread can be started
for, is closed at once (and counted in ``rejected``) while the acceptor goes on.

The fence's target half: a connection's frames are handled one after the other on its
thread, so when an ABORT is read every earlier frame of its job has been written into the
region (or refused, closing the connection). The ACK DROPPED that answers it tells the
writer that no byte of the job can land any more.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable

import torch

from transfer.base import KVRegion
from transfer.errors import TransferError, TransferTimeout
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.tcp_frames import (
    HEADER_SIZE,
    POLL_SECONDS,
    RANGE,
    TRANSPORT_NAME,
    AckStatus,
    Frame,
    FrameError,
    FrameKind,
    PeerClosed,
    decode_ranges,
    format_address,
    key_bytes,
    recv_exactly,
    recv_views,
    send_exactly,
    set_io_tick,
)

log = logging.getLogger(__name__)


class _Rejected(Exception):
    """A frame this receiver refuses; the connection that sent it is closed."""


def tune_socket(sock: socket.socket, send_tick: float, recv_tick: float) -> None:
    """The receiver's settings for a KV connection. Buffer sizes stay autotuned: setting
    SO_SNDBUF/SO_RCVBUF turns the kernel's autotuning off and bought nothing here."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_io_tick(sock, send_tick, recv_tick)


class TcpRegion(KVRegion):
    """A KV pool in this process's memory, filled by the transport's receiver."""

    def __init__(self, layout: KVLayout, receiver: TcpReceiver) -> None:
        length = layout.total_bytes
        handle = MemoryRegionHandle(
            transport=TRANSPORT_NAME,
            address=receiver.address,
            length=length,
            key=secrets.token_hex(16),
            layout=layout,
            region_id=uuid.uuid4().hex,
        )
        super().__init__(handle, torch.zeros(length, dtype=torch.uint8))
        self.raw_key = key_bytes(handle.key)
        self.view = memoryview(self.tensor.numpy())
        self._receiver = receiver
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop accepting frames for this region and close connections writing into it."""
        if self._closed:
            return
        self._closed = True
        self._receiver.remove(self)


class TcpReceiver:
    """One listening socket; a handler thread per connection writes frames into regions."""

    def __init__(
        self,
        host: str,
        port: int,
        advertise_host: str,
        idle_timeout: float,
        io_timeout: float,
        *,
        max_connections: int,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=64)
        except OSError as exc:
            raise TransferError(f"cannot listen on {format_address(host, port)}: {exc}") from exc
        self._listener.settimeout(POLL_SECONDS * 4)
        self.address = format_address(advertise_host, self._listener.getsockname()[1])
        self._idle_timeout = idle_timeout
        self._io_timeout = io_timeout
        self._max_connections = max_connections
        self._tick = min(POLL_SECONDS * 4, io_timeout / 2, idle_timeout / 2)
        self._lock = threading.Lock()
        self._regions: dict[bytes, TcpRegion] = {}
        self._conns: dict[socket.socket, TcpRegion | None] = {}
        self._threads: set[threading.Thread] = set()
        self._stop = threading.Event()
        self.rejected = 0
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self._acceptor.start()

    @property
    def healthy(self) -> bool:
        """Whether new connections are still accepted (False once closed, or if the acceptor
        died)."""
        return self._acceptor.is_alive()

    def add(self, region: TcpRegion) -> None:
        with self._lock:
            self._regions[region.raw_key] = region

    def remove(self, region: TcpRegion) -> None:
        with self._lock:
            self._regions.pop(region.raw_key, None)
            doomed = [conn for conn, bound in self._conns.items() if bound is region]
        for conn in doomed:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=2.0)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    conn, peer = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._stop.is_set():
                        return
                    time.sleep(POLL_SECONDS)  # e.g. EMFILE: back off, keep serving
                    continue
                self._admit(conn, peer)
        except Exception:
            log.exception("kv receiver: the acceptor failed; no more connections are served")
        finally:
            # Dialers are refused at once rather than queued where nobody accepts them.
            self._listener.close()

    def _admit(self, conn: socket.socket, peer: object) -> None:
        """Serve ``conn`` on a thread of its own, or close it: over the cap, or no thread."""
        thread = threading.Thread(
            target=self._serve, args=(conn, peer), name="kv-recv", daemon=True
        )
        with self._lock:
            full = len(self._conns) >= self._max_connections
            if not full:
                self._conns[conn] = None
                self._threads.add(thread)
        if full:
            self._reject(None, peer, f"{self._max_connections} connections are open already")
            conn.close()  # counted first: whoever sees it closed sees it counted
            return
        try:
            tune_socket(conn, self._tick, self._tick)
            thread.start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread to be had now
            self._reject(None, peer, f"cannot serve it: {exc}")
        finally:
            # Never started: the connection ends here. An exception other than the two
            # above (a bug) goes on to stop the acceptor, which ``healthy`` reports.
            if thread.ident is None:
                with self._lock:
                    self._conns.pop(conn, None)
                    self._threads.discard(thread)
                conn.close()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        region: TcpRegion | None = None
        pending: dict[int, tuple[int, float]] = {}  # job tag -> (bytes, first frame time)
        header = bytearray(HEADER_SIZE)
        header_view = memoryview(header)
        stop = self._stop.is_set
        try:
            # A connection that names no region yet holds a slot of max_connections for
            # nothing: its first frame gets io_timeout, not idle_timeout.
            while recv_exactly(
                conn,
                header_view,
                inactivity=self._io_timeout if region is None else self._idle_timeout,
                stop=stop,
                eof_ok=True,
            ):
                try:
                    frame = Frame.decode(header)
                except FrameError as exc:
                    raise _Rejected(str(exc)) from None
                with self._lock:
                    found = self._regions.get(frame.key)
                if found is None:
                    raise _Rejected("frame for an unknown region key")
                if region is None:
                    region = found
                    with self._lock:
                        self._conns[conn] = region
                elif found is not region:
                    raise _Rejected("frame for a second region on one connection")
                if frame.kind is FrameKind.DATA:
                    self._receive_data(conn, frame, region, stop)
                    seen, first = pending.get(frame.tag, (0, time.monotonic()))
                    pending[frame.tag] = (seen + frame.length, first)
                    region.counter.add(bytes=frame.length)
                elif frame.kind is FrameKind.END:
                    seen, first = pending.pop(frame.tag, (0, time.monotonic()))
                    ok = seen == frame.length
                    if ok:
                        region.counter.add(seconds=time.monotonic() - first, jobs=1)
                    else:
                        region.counter.add(failures=1)
                    self._answer(conn, frame, seen, AckStatus.OK if ok else AckStatus.MISMATCH)
                elif frame.kind is FrameKind.ABORT:
                    # Every earlier frame of the job was handled on this thread already.
                    seen, _ = pending.pop(frame.tag, (0, 0.0))
                    self._answer(conn, frame, seen, AckStatus.DROPPED)
                else:
                    raise _Rejected(f"unexpected {frame.kind.name} frame")
        except _Rejected as exc:
            self._reject(region, peer, str(exc))
        except PeerClosed as exc:
            if stop() or (region is not None and region.closed):
                log.info("kv receiver: connection from %s ended: %s", peer, exc)
            else:  # a writer that dies or gives up mid-frame; its job never gets an ACK
                self._reject(region, peer, f"truncated frame: {exc}")
        except (OSError, TransferError) as exc:
            log.info("kv receiver: connection from %s ended: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _answer(self, conn: socket.socket, frame: Frame, seen: int, status: AckStatus) -> None:
        """ACK ``frame`` (an END or ABORT) with ``status`` and the job's ``seen`` bytes."""
        ack = Frame(FrameKind.ACK, frame.key, frame.tag, length=seen, status=status)
        deadline = time.monotonic() + self._io_timeout
        send_exactly(conn, ack.encode(), give_up=lambda: past(deadline))

    def _receive_data(
        self, conn: socket.socket, frame: Frame, region: TcpRegion, stop: Callable[[], bool]
    ) -> None:
        """Read a DATA frame's range list, check it, land its payloads in the region."""
        listing = bytearray(frame.count * RANGE.size)
        try:
            recv_exactly(conn, memoryview(listing), inactivity=self._io_timeout, stop=stop)
        except PeerClosed as exc:
            raise PeerClosed(f"in the range list of a DATA frame: {exc}") from None
        try:
            ranges = decode_ranges(listing, frame, region.handle.length)
        except FrameError as exc:
            raise _Rejected(str(exc)) from None
        view = region.view
        try:
            recv_views(
                conn,
                [view[offset : offset + length] for offset, length in ranges],
                inactivity=self._io_timeout,
                stop=stop,
            )
        except PeerClosed as exc:
            raise PeerClosed(f"in the payload of a DATA frame: {exc}") from None

    def _reject(self, region: TcpRegion | None, peer: object, reason: str) -> None:
        with self._lock:
            self.rejected += 1
        if region is not None:
            region.counter.add(failures=1)
        log.warning("kv receiver: closing connection from %s: %s", peer, reason)


def past(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TransferTimeout("peer stopped reading")

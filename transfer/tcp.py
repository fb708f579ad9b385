"""Any-host transport: frames over TCP into a region served by a ``TcpReceiver``.

Initiator side: a ``TcpWriter``'s owner thread holds one persistent, non-blocking connection
per region (reconnecting after a failure) and alone reads and writes it. It turns each job's
written layers into DATA frames of about ``FRAME_BYTES`` (header and range list, then the
ranges' payloads, gathered by ``sendmsg`` straight from the source pool's memory) on one
outbox, sends END once ``finish`` came and every layer is framed, and completes the job when
the receiver's ACK confirms the byte count.

The fence: a failed job's queued frames are dropped; if none of its bytes reached the
socket it is quiet at once. Otherwise an ABORT follows its frames (a frame already half
sent is finished first: the stream must stay whole) and the job drains until the receiver
answers the ABORT with ACK DROPPED. Frames of one connection are handled in order, so that
answer means the receiver wrote or refused every byte of the job: none can land any more,
and the job resolves quiet. A connection that dies first, a drain with no answer within
``DRAIN_TIMEOUT_S`` (the connection is then closed), or a job that runs out of time
mid-frame (the connection is closed, failing every job on it) leaves bytes of unknown
fate: those jobs resolve not quiet. Target side: see ``transfer/tcp_receiver.py``.
"""

from __future__ import annotations

import itertools
import selectors
import socket
import time
from collections import deque
from dataclasses import dataclass, field

from transfer.base import KVRegion, KVSource, TransferJob, Transport
from transfer.errors import TransferError, TransferTimeout
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.tcp_frames import (
    FRAME_BYTES,
    HEADER_SIZE,
    IOV_MAX,
    MAX_RANGES,
    TRANSPORT_NAME,
    AckStatus,
    Frame,
    FrameError,
    FrameKind,
    advance,
    encode_data,
    key_bytes,
    parse_address,
    split_frames,
)
from transfer.tcp_receiver import TcpReceiver, TcpRegion
from transfer.writer import Drop, JobWork, OwnerThreadWriter, lowest_run


class TcpWork(JobWork):
    """A job's progress on the tcp transport (owner thread only)."""

    def __init__(self, job: TransferJob) -> None:
        super().__init__(job)
        self.conn: _Connection | None = None  # the connection its frames go on, once framed
        self.tag = 0  # its frame tag on that connection
        self.framed = 0  # payload bytes queued as DATA frames
        self.end_length = -1  # what its END frame declared, once queued
        self.on_wire = False  # a byte of its DATA frames went into the socket


@dataclass(eq=False)
class _Outgoing:
    """A frame on the outbox: what is left to send of it, and whose it is."""

    work: TcpWork | None
    views: list[memoryview]
    payload: int  # DATA payload bytes (0 for END and ABORT)
    started: bool = False


@dataclass(eq=False)
class _Connection:
    """One connection of a writer: its socket, the jobs with frames on it, its outbox."""

    sock: socket.socket
    # tag -> job awaiting an ACK: to its END, or (once it failed) to its ABORT
    bound: dict[int, TcpWork] = field(default_factory=dict)
    outbox: deque[_Outgoing] = field(default_factory=deque)
    acks: bytearray = field(default_factory=bytearray)
    blocked: bool = False  # the socket buffer was full: wait until it has room
    dead: bool = False


class TcpWriter(OwnerThreadWriter):
    """Streams one source pool's blocks into one remote region, on its owner thread."""

    def __init__(
        self,
        handle: MemoryRegionHandle,
        source: KVSource,
        connect_timeout: float,
    ) -> None:
        if source.tensor.device.type != "cpu":
            raise TransferError(f"tcp sends from host memory, not {source.tensor.device}")
        super().__init__(handle, source)
        self._address = parse_address(handle.address)
        self._key = key_bytes(handle.key)
        self._connect_timeout = connect_timeout
        self._tags = itertools.count(1)
        self._payload = memoryview(source.tensor.numpy())
        # Connect now, on the caller's thread, so an unreachable target fails connect(); the
        # owner thread takes the connection over when it starts.
        self._conn: _Connection | None = self._open(time.monotonic() + connect_timeout)
        self._launch()

    def _new_work(self, job: TransferJob) -> TcpWork:
        return TcpWork(job)

    # --- the connection ------------------------------------------------------------------

    def _open(self, deadline: float) -> _Connection:
        timeout = max(0.001, min(self._connect_timeout, deadline - time.monotonic()))
        try:
            sock = socket.create_connection(self._address, timeout=timeout)
        except OSError as exc:
            raise TransferError(f"cannot connect to {self.handle.address}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        conn = _Connection(sock)
        self._watch_conn(conn, selectors.EVENT_READ)
        return conn

    def _watch_conn(self, conn: _Connection, events: int) -> None:
        """Have the loop call ``_on_ready`` when ``conn``'s socket is ready for ``events``."""
        self._watch(conn.sock, events, lambda ready: self._on_ready(conn, ready))

    def _connection(self, work: TcpWork) -> _Connection:
        if self._conn is None or self._conn.dead:
            self._conn = self._open(work.job.deadline)
        return self._conn

    def _kill(self, conn: _Connection, reason: str) -> None:
        """Close ``conn``; every job with frames on it fails, not quiet if any of its bytes
        went out (the receiver may still read them from its socket buffer)."""
        if conn.dead:
            return
        conn.dead = True
        self._unwatch(conn.sock)
        conn.sock.close()
        if self._conn is conn:
            self._conn = None
        conn.outbox.clear()
        error = TransferError(f"connection to {self.handle.address} lost: {reason}")
        bound, conn.bound = conn.bound, {}
        for work in bound.values():
            if work.error is None:
                self._fail(work, error)
            else:
                self._resolve(work, quiet=False)  # draining: its ABORT goes unanswered

    # --- hooks ---------------------------------------------------------------------------

    def _drop_connection(self, work: JobWork) -> None:
        if self._conn is not None:
            self._kill(self._conn, "injected fault: connection dropped")

    def _move(self) -> None:
        self._each_pending(self._frame)
        if self._conn is not None:
            self._flush(self._conn)

    def _frame(self, work: JobWork) -> None:
        """Queue ``work``'s pending layers as DATA frames; bind it to the connection first."""
        assert isinstance(work, TcpWork)
        if work.conn is None:
            work.conn = self._connection(work)
            work.tag = next(self._tags)  # never reused: a late ACK cannot complete another job
            work.conn.bound[work.tag] = work
        conn = work.conn
        while work.pending:
            start, stop = lowest_run(work.pending)
            self._inject(work)
            ranges = [r for layer in range(start, stop) for r in work.job.blocks.ranges(layer)]
            for i, j, size in split_frames([n for _, _, n in ranges], MAX_RANGES, FRAME_BYTES):
                part = ranges[i:j]
                head = encode_data(self._key, work.tag, [(d, n) for _, d, n in part], size)
                views = [memoryview(head), *(self._payload[s : s + n] for s, _, n in part)]
                conn.outbox.append(_Outgoing(work, views, size))
                work.framed += size
            self._moved(work, start, stop)

    def _end(self, work: JobWork) -> None:
        assert isinstance(work, TcpWork)
        if work.conn is None:
            self._succeed(work)  # nothing was written: nothing to confirm
            return
        work.end_length = work.framed
        end = Frame(FrameKind.END, self._key, work.tag, length=work.framed).encode()
        work.conn.outbox.append(_Outgoing(work, [memoryview(end)], 0))
        self._flush(work.conn)

    def _drop(self, work: JobWork) -> Drop:
        assert isinstance(work, TcpWork)
        conn = work.conn
        if conn is None:
            return Drop.QUIET  # nothing of it was framed
        if conn.dead:
            return Drop.UNKNOWN if work.on_wire else Drop.QUIET
        head = conn.outbox[0] if conn.outbox else None
        half_sent = head is not None and head.work is work and head.started
        if half_sent and isinstance(work.error, TransferTimeout):
            # Out of time mid-frame (the receiver stopped reading): the stream cannot carry
            # other jobs any more.
            self._kill(conn, f"{work.job.request_id!r} timed out mid-frame")
            return Drop.UNKNOWN
        conn.outbox = deque(
            f for f in conn.outbox if f.work is not work or (f is head and half_sent)
        )
        if not work.on_wire:
            conn.bound.pop(work.tag, None)
            return Drop.QUIET
        # Its bytes may still sit in socket buffers on their way into the region: it stays
        # bound until the receiver's answer to this ABORT says it handled all of them.
        abort = Frame(FrameKind.ABORT, self._key, work.tag).encode()
        conn.outbox.append(_Outgoing(None, [memoryview(abort)], 0))
        return Drop.DRAINING

    def _give_up(self, work: JobWork) -> None:
        assert isinstance(work, TcpWork)
        if work.conn is not None:
            self._kill(work.conn, f"no answer to the abort of {work.job.request_id!r}")

    def _has_ready_bytes(self) -> bool:
        conn = self._conn
        return conn is not None and bool(conn.outbox) and not conn.blocked

    def _release(self) -> None:
        if self._conn is not None:
            self._kill(self._conn, "writer closed")

    # --- socket I/O (owner thread) -----------------------------------------------------

    def _flush(self, conn: _Connection) -> None:
        """Send from the outbox until it is empty or the socket buffer is full."""
        while conn.outbox and not conn.dead:
            head = conn.outbox[0]
            try:
                sent = conn.sock.sendmsg(head.views[:IOV_MAX])
            except BlockingIOError:
                conn.blocked = True
                self._watch_conn(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
                return
            except OSError as exc:
                self._kill(conn, f"send failed: {exc}")
                return
            head.started = True
            if head.payload:
                assert head.work is not None
                head.work.on_wire = True
            head.views = advance(head.views, sent)
            if head.views:
                continue
            conn.outbox.popleft()
            if head.work is not None:
                self._landed(head.work, head.payload)
        if conn.blocked and not conn.dead:  # drained: stop waiting for room
            conn.blocked = False
            self._watch_conn(conn, selectors.EVENT_READ)

    def _on_ready(self, conn: _Connection, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        if events & selectors.EVENT_READ and not conn.dead:
            self._read_acks(conn)

    def _read_acks(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            self._kill(conn, f"receiving acks failed: {exc}")
            return
        if not data:
            self._kill(conn, "receiver closed the connection")
            return
        conn.acks += data
        while len(conn.acks) >= HEADER_SIZE and not conn.dead:
            try:
                frame = Frame.decode(bytes(conn.acks[:HEADER_SIZE]))
            except FrameError as exc:
                self._kill(conn, f"bad frame from the receiver: {exc}")
                return
            del conn.acks[:HEADER_SIZE]
            if frame.kind is not FrameKind.ACK:
                self._kill(conn, f"unexpected {frame.kind.name} frame from the receiver")
                return
            work = conn.bound.get(frame.tag)
            if work is None:
                continue  # a job that ended already
            if work.error is not None:
                if frame.status == AckStatus.DROPPED:
                    del conn.bound[frame.tag]
                    self._resolve(work, quiet=True)
                continue  # else the answer to its END: the one to its ABORT follows
            if frame.status == AckStatus.OK and frame.length == work.end_length:
                del conn.bound[frame.tag]
                self._succeed(work)
            else:  # stays bound: a job with bytes out drains until its ABORT is answered
                self._fail(
                    work,
                    TransferError(
                        f"receiver got {frame.length} bytes of {work.job.request_id!r}, "
                        f"{work.end_length} were sent"
                    ),
                )


class TcpTransport(Transport):
    """``tcp``: regions served by a listener on ``host:port`` (0 = ephemeral port).

    ``advertise_host`` is the host peers dial (default: ``host``, or this machine's name when
    ``host`` is a wildcard). ``idle_timeout`` closes connections silent between frames;
    ``io_timeout`` bounds silence inside a frame and before a new connection's first one;
    ``max_connections`` caps the connections served at once (one thread each; more are
    closed at once); ``connect_timeout`` bounds a writer's dial. Connections send with the
    system's TCP congestion control.
    """

    name = TRANSPORT_NAME

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        idle_timeout: float = 300.0,
        io_timeout: float = 10.0,
        max_connections: int = 64,
        connect_timeout: float = 5.0,
    ) -> None:
        if max_connections < 1:
            raise TransferError(f"max_connections must be at least 1, got {max_connections}")
        super().__init__()
        if advertise_host is None:
            advertise_host = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self._receiver: TcpReceiver | None = None

    @property
    def rejected_connections(self) -> int:
        """Connections the receiver closed for a bad frame (wrong key, bounds, garbage), or
        took none of: over ``max_connections``, or no thread to serve one."""
        return 0 if self._receiver is None else self._receiver.rejected

    @property
    def healthy(self) -> bool:
        """False once the receiver stopped accepting connections (its acceptor died): no new
        writer can reach its regions, so the worker should stop reporting SERVING."""
        return self._receiver is None or self._receiver.healthy

    def _register(self, layout: KVLayout) -> KVRegion:
        with self._lock:
            if self._receiver is None:
                self._receiver = TcpReceiver(
                    self.host,
                    self.port,
                    self.advertise_host,
                    self.idle_timeout,
                    self.io_timeout,
                    max_connections=self.max_connections,
                )
            receiver = self._receiver
        region = TcpRegion(layout, receiver)
        receiver.add(region)
        return region

    def _open_writer(self, handle: MemoryRegionHandle, source: KVSource) -> TcpWriter:
        return TcpWriter(handle, source, self.connect_timeout)

    def close(self) -> None:
        super().close()
        with self._lock:
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

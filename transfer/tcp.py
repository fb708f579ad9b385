"""Any-host transport: frames over TCP into a region served by a ``TcpReceiver``.

Initiator side: a ``TcpWriter`` holds one persistent connection per region (reconnecting
after a failure). Whoever moves a job's writes (the sender thread while the model computes,
the thread in ``finish`` for the rest; see ``transfer/sender.py``) streams them as DATA
frames of about ``FRAME_BYTES`` (header and range list, then the ranges' payloads, gathered
by one ``sendmsg`` straight from the source tensor's memory); a stream lock keeps frames
whole. ``finish`` then sends END and an ack-reader thread completes the job when the
receiver confirms the byte count. A job whose deadline passes in the middle of a frame
desynchronizes the stream, so the connection is closed and every job with bytes on it fails
with ``TransferError``. Sockets block with kernel timeouts as ticks (no poll per call; see
``transfer/tcp_frames.py``). Target side: see ``transfer/tcp_receiver.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from transfer.base import KVRegion, Transport
from transfer.errors import TransferError, TransferTimeout
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.plan import ByteRange
from transfer.sender import QueuedJob, QueuedWriter, Write, flat_batches
from transfer.tcp_frames import (
    FRAME_BYTES,
    HEADER_SIZE,
    MAX_RANGES,
    POLL_SECONDS,
    TRANSPORT_NAME,
    AckStatus,
    Frame,
    FrameKind,
    check_congestion,
    encode_data,
    key_bytes,
    parse_address,
    recv_exactly,
    send_exactly,
    send_views,
    set_congestion,
    split_frames,
)
from transfer.tcp_receiver import TcpReceiver, TcpRegion, past, tune_socket

# The ack reader blocks in recv; a writer's close or a dead connection shuts the socket
# down, which wakes it at once, so its tick only bounds how long a missed wake-up lasts.
_ACK_TICK_SECONDS = 0.5

# Bound on sending a 48-byte ABORT after a job failed: the receiver may be stuck.
_NOTICE_SECONDS = 1.0


class _Connection:
    """One TCP connection of a writer and the jobs that have bytes on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.jobs: dict[int, QueuedJob] = {}
        self.dead = False
        self.reason = ""
        self.reader: threading.Thread | None = None


@dataclass
class _Binding:
    """A job's place on a connection: the connection, the job's frame tag, and the byte
    count its END frame declared (-1 until one is sent; with its last DATA frame when
    ``finish`` moved that one). It is set just before the send: the ack may be read before
    the sending thread runs again, and a failed send fails the job."""

    conn: _Connection
    tag: int
    end_length: int = -1

    @property
    def ended(self) -> bool:
        return self.end_length >= 0


class TcpWriter(QueuedWriter):
    """Streams DATA frames into one remote region over a persistent connection.

    The sender thread and a thread in ``finish`` may both send: the stream lock keeps each
    frame whole on the wire and guards the current connection.
    """

    def __init__(
        self, handle: MemoryRegionHandle, connect_timeout: float, congestion: str | None = None
    ) -> None:
        super().__init__(handle)
        self._congestion = congestion
        self._stream = threading.Lock()
        self._host, self._port = parse_address(handle.address)
        self._key = key_bytes(handle.key)
        self._connect_timeout = connect_timeout
        self._tags = itertools.count(1)
        # Connect now so an unreachable target fails connect(), not the first job.
        self._conn: _Connection | None = self._open(time.monotonic() + connect_timeout)
        self._start()

    def _open(self, deadline: float) -> _Connection:
        timeout = max(0.001, min(self._connect_timeout, deadline - time.monotonic()))
        try:
            sock = socket.create_connection((self._host, self._port), timeout=timeout)
        except OSError as exc:
            raise TransferError(f"cannot connect to {self.handle.address}: {exc}") from exc
        try:
            tune_socket(sock, POLL_SECONDS, _ACK_TICK_SECONDS)
            if self._congestion is not None:
                set_congestion(sock, self._congestion)
        except (OSError, TransferError):
            sock.close()
            raise
        conn = _Connection(sock)
        conn.reader = threading.Thread(
            target=self._read_acks, args=(conn,), name="kv-acks", daemon=True
        )
        conn.reader.start()
        return conn

    @contextlib.contextmanager
    def _streaming(self, job: QueuedJob) -> Iterator[None]:
        """Hold the stream lock, waiting no longer than ``job``'s deadline."""
        if not self._stream.acquire(timeout=max(0.0, job.deadline - time.monotonic())):
            raise self._timeout(job)
        try:
            yield
        finally:
            self._stream.release()

    def _drop(self, conn: _Connection) -> None:
        """Under the stream lock: the one place a connection's socket is closed."""
        self._kill(conn, "writer closed")
        if conn.reader is not None:
            conn.reader.join(timeout=2.0)
        conn.sock.close()

    def _kill(self, conn: _Connection, reason: str) -> None:
        """Any thread: mark ``conn`` dead, wake its users, fail the jobs with bytes on it."""
        with self._lock:
            if conn.dead:
                return
            conn.dead = True
            conn.reason = reason
            jobs = list(conn.jobs.values())
            conn.jobs.clear()
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        for job in jobs:
            self._fail(job, TransferError(f"connection to {self.handle.address} lost: {reason}"))

    def _bound(self, job: QueuedJob) -> _Binding:
        """The connection ``job``'s frames go on; a job never moves to another connection."""
        binding: _Binding | None = job.transport_state
        if binding is not None:
            if binding.conn.dead:
                raise TransferError(
                    f"connection to {self.handle.address} lost: {binding.conn.reason}"
                )
            return binding
        if self._conn is None or self._conn.dead:
            if self._conn is not None:
                self._drop(self._conn)
                self._conn = None
            self._conn = self._open(job.deadline)
        # A fresh tag per job, not a hash of the request id: a retried request's late ack
        # must not complete its successor.
        binding = _Binding(self._conn, next(self._tags))
        with self._lock:
            self._conn.jobs[binding.tag] = job
        job.transport_state = binding
        return binding

    def _send(self, conn: _Connection, job: QueuedJob, views: Sequence[memoryview | bytes]) -> None:
        def give_up() -> None:
            if conn.dead:
                raise TransferError(f"connection to {self.handle.address} lost: {conn.reason}")
            if time.monotonic() > job.deadline:
                raise self._timeout(job)

        try:
            send_views(conn.sock, views, give_up=give_up)
        except TransferTimeout as exc:
            # Half a frame is on the wire: the stream is unusable for every job on it.
            self._fail(job, exc)
            self._kill(conn, f"{job.request_id!r} timed out mid-frame")
            raise
        except OSError as exc:
            self._kill(conn, f"send failed: {exc}")
            raise TransferError(f"send to {self.handle.address} failed: {exc}") from exc

    def _move(self, job: QueuedJob, writes: Sequence[Write]) -> None:
        with self._streaming(job):
            for src, ranges, _ in flat_batches(writes):
                self._send_frames(job, src, ranges, end=False)

    def _move_here(self, job: QueuedJob, writes: Sequence[Write]) -> None:
        """``_move``, and the job's END frame goes in the last DATA frame's sendmsg: the
        job's last bytes, so the receiver finds the END right behind them (no extra send)."""
        with self._streaming(job):
            batches = flat_batches(writes)
            for i, (src, ranges, _) in enumerate(batches):
                self._send_frames(job, src, ranges, end=i == len(batches) - 1)

    def _send_frames(
        self, job: QueuedJob, src: torch.Tensor, ranges: Sequence[ByteRange], *, end: bool
    ) -> None:
        """DATA frames of about ``FRAME_BYTES`` each: header and range list, then the
        payloads, gathered from the source's memory by one sendmsg; with ``end``, the job's
        END frame follows the last one in the same sendmsg."""
        binding = self._bound(job)
        payload = memoryview(src.detach().numpy())
        frames = split_frames([n for _, _, n in ranges], MAX_RANGES, FRAME_BYTES)
        for i, (start, stop, size) in enumerate(frames):
            # An aborted job still completes the frame in flight (the stream stays usable),
            # then stops; a deadline stops it mid-frame (see _send).
            if job.terminal:
                return
            part = ranges[start:stop]
            head = encode_data(self._key, binding.tag, [(d, n) for _, d, n in part], size)
            views: list[memoryview | bytes] = [head, *(payload[s : s + n] for s, _, n in part)]
            last = end and i == len(frames) - 1
            if last:
                binding.end_length = job.bytes_moved + size
                views.append(
                    Frame(FrameKind.END, self._key, binding.tag, length=binding.end_length).encode()
                )
            self._send(binding.conn, job, views)
            self._moved(job, size)

    def _end(self, job: QueuedJob) -> None:
        binding: _Binding | None = job.transport_state
        if binding is None:
            self._complete(job)  # nothing was written: nothing to confirm
            return
        if binding.ended:
            return  # the END went out with the last DATA frame; the ack reader completes
        with self._streaming(job):
            binding = self._bound(job)
            binding.end_length = job.bytes_moved
            end = Frame(FrameKind.END, self._key, binding.tag, length=binding.end_length)
            self._send(binding.conn, job, [end.encode()])
        # The ack reader completes the job.

    def _on_failed(self, job: QueuedJob) -> None:
        binding: _Binding | None = job.transport_state
        if binding is None or binding.conn.dead:
            return
        conn = binding.conn
        with self._lock:
            if conn.jobs.get(binding.tag) is job:
                del conn.jobs[binding.tag]
        deadline = time.monotonic() + _NOTICE_SECONDS

        def give_up() -> None:
            if conn.dead:
                raise TransferError("connection lost")
            past(deadline)

        notice = Frame(FrameKind.ABORT, self._key, binding.tag).encode()
        if not self._stream.acquire(timeout=_NOTICE_SECONDS):
            self._kill(conn, "could not send ABORT: the stream stayed busy")
            return
        try:
            send_exactly(conn.sock, notice, give_up=give_up)
        except (OSError, TransferError) as exc:
            self._kill(conn, f"sending ABORT failed: {exc}")
        finally:
            self._stream.release()

    def _read_acks(self, conn: _Connection) -> None:
        header = bytearray(HEADER_SIZE)
        view = memoryview(header)
        reason = "receiver closed the connection"
        try:
            while recv_exactly(
                conn.sock,
                view,
                inactivity=float("inf"),
                stop=lambda: conn.dead or self._closed,
                eof_ok=True,
            ):
                frame = Frame.decode(header)
                if frame.kind is not FrameKind.ACK:
                    reason = f"unexpected {frame.kind.name} frame from the receiver"
                    break
                with self._lock:
                    job = conn.jobs.pop(frame.tag, None)
                if job is None:
                    continue  # the job already failed or was aborted
                # What the END declared (set before it was sent: this ack may be read
                # before the sending thread has counted its last frame in bytes_moved).
                sent = job.transport_state.end_length
                if frame.status == AckStatus.OK and frame.length == sent:
                    self._complete(job)
                else:
                    self._fail(
                        job,
                        TransferError(
                            f"receiver got {frame.length} bytes of {job.request_id!r}, "
                            f"{sent} were sent"
                        ),
                    )
        except (OSError, TransferError) as exc:
            reason = f"receiving acks failed: {exc}"
        self._kill(conn, reason)

    def _interrupt(self) -> None:
        conn = self._conn
        if conn is not None:
            self._kill(conn, "writer closed")

    def _release(self) -> None:
        # A finish() on another thread may still be leaving a send (the connection is dead
        # by now, so not for long); closing the socket under it would be a use after close.
        locked = self._stream.acquire(timeout=5.0)
        try:
            if self._conn is not None:
                self._drop(self._conn)
                self._conn = None
        finally:
            if locked:
                self._stream.release()


class TcpTransport(Transport):
    """``tcp``: regions served by a listener on ``host:port`` (0 = ephemeral port).

    ``advertise_host`` is the host peers dial (default: ``host``, or this machine's name when
    ``host`` is a wildcard). ``idle_timeout`` closes connections silent between frames;
    ``io_timeout`` bounds silence inside a frame; ``connect_timeout`` bounds a writer's dial.
    ``congestion`` is the TCP congestion control the writers' connections send with (Linux
    ``TCP_CONGESTION``; ``None``: the system's default). The sender's choice is the one that
    counts, and a name this process may not use fails here, not at the first connection.
    Between two processes on one host ``reno`` avoids what ``bbr`` does there: BBR paces,
    segments it held back go out from another CPU, and on loopback they arrive out of order
    and trigger fast retransmits (measured: docs/benchmarks.md, the transfer section).
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
        connect_timeout: float = 5.0,
        congestion: str | None = None,
    ) -> None:
        if congestion is not None:
            check_congestion(congestion)
        super().__init__()
        if advertise_host is None:
            advertise_host = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self.connect_timeout = connect_timeout
        self.congestion = congestion
        self._receiver: TcpReceiver | None = None

    @property
    def rejected_connections(self) -> int:
        """Connections the receiver closed for a bad frame (wrong key, bounds, garbage)."""
        return 0 if self._receiver is None else self._receiver.rejected

    def _register(self, layout: KVLayout) -> KVRegion:
        with self._lock:
            if self._receiver is None:
                self._receiver = TcpReceiver(
                    self.host, self.port, self.advertise_host, self.idle_timeout, self.io_timeout
                )
            receiver = self._receiver
        region = TcpRegion(layout, receiver)
        receiver.add(region)
        return region

    def _open_writer(self, handle: MemoryRegionHandle) -> TcpWriter:
        return TcpWriter(handle, self.connect_timeout, self.congestion)

    def close(self) -> None:
        super().close()
        with self._lock:
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

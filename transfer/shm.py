"""Same-host transport: the target's KV pool lives in a POSIX shared-memory segment.

The target creates ``<shm_dir>/pdserve-kv-<random>`` (tmpfs; ``posix_fallocate`` claims the
pages up front so a full ``/dev/shm`` fails here with a clear error, not with SIGBUS later),
maps it and builds its pool on the mapping. A writer maps the same segment and copies its
source ranges straight into it (numpy copies from the source pool's memory into the
mapping, without the GIL; a request's block runs are copied for many layers in one strided
call), no intermediate buffer, no acknowledgement needed (the copy *is* the delivery). A
source on another device is copied with ``copy_``.

Liveness without a connection: the owner holds an exclusive ``flock`` on the segment for its
whole life; the kernel drops it when the owner exits, even on SIGKILL. A writer probes with a
non-blocking shared lock when a job begins, between its writes and when it ends, unless its
last probe is under ``_ALIVE_FOR_S`` old: if it gets the lock the owner is gone, the job fails
with ``TransferError``, and the writer unlinks the orphaned segment. So a job into an owner
dead for longer than ``_ALIVE_FOR_S`` fails (at its begin, or as soon as it ends); one into
an owner that died just now may succeed, as it always could (an owner may die right after
any probe): that owner is the decode worker that called ``Prefill``, and the call's
cancellation tells the prefill worker anyway. Probes are shared by jobs close together
because they are not free: a system call, ~2 us warm, 15 to 35 us with cold caches (e.g.
right after a copy), against ~0.6 ms to copy a 128-token request.
``sweep_stale_segments`` does the same for a whole directory (call it at worker start).
``handle.key`` is not checked here: file permissions (0600, same user) guard the segment.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import time
import uuid
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from transfer.base import KVRegion, Transport
from transfer.errors import TransferError
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.plan import BlockPlan, ByteRange
from transfer.sender import QueuedJob, QueuedWriter, Write

SEGMENT_PREFIX = "pdserve-kv-"
# Copies are split so a deadline or an abort is noticed within a few milliseconds.
_COPY_CHUNK = 8 << 20
# How long a liveness probe's answer stands (see the module docstring).
_ALIVE_FOR_S = 0.02


# madvise(MADV_POPULATE_WRITE), Linux 5.14+ (Python's mmap module has no name for it).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE = mmap.PAGESIZE


def populate(mapping: mmap.mmap) -> None:
    """Map every page of ``mapping`` into this process now, without changing its bytes.

    A fresh mapping of a segment is empty: each 4 KiB page costs a fault on its first
    touch, ~0.7 ms per MiB here (a 1,040-token request's 46 MiB of KV: ~30 ms). Left to
    the first decode step that reads a newly arrived request's KV, that stalls every
    stream in the batch. So the owner populates its mapping once, when it registers the
    region at startup (~0.25 ms per MiB)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
        return
    except (OSError, ValueError):  # an older kernel: read one byte of every page instead
        pass
    np.frombuffer(mapping, dtype=np.uint8)[::_PAGE].sum()


def _owner_alive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _unlink_if_same(path: str, fd: int) -> bool:
    """Unlink ``path`` only if it is still the file ``fd`` refers to (not a newer one)."""
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _release_segment(path: str, fd: int) -> None:
    _unlink_if_same(path, fd)
    os.close(fd)  # releases the flock


def sweep_stale_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink pdserve segments in ``shm_dir`` whose owner died; return their paths."""
    removed: list[str] = []
    for name in sorted(os.listdir(shm_dir)):
        if not name.startswith(SEGMENT_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not _owner_alive(fd) and _unlink_if_same(path, fd):
                removed.append(path)
        finally:
            os.close(fd)
    return removed


class ShmRegion(KVRegion):
    """A KV pool in a shared-memory segment this process created and keeps locked."""

    def __init__(self, layout: KVLayout, shm_dir: str, mode: int) -> None:
        region_id = uuid.uuid4().hex
        length = layout.total_bytes
        path = os.path.join(shm_dir, SEGMENT_PREFIX + region_id)
        # Created under a name sweepers ignore, locked, then renamed: a segment is never
        # visible unlocked, so a sweeper cannot mistake a newborn for an orphan.
        tmp = os.path.join(shm_dir, f".{SEGMENT_PREFIX}tmp-{region_id}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        except OSError as exc:
            raise TransferError(f"cannot create shared-memory segment in {shm_dir}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(fd, 0, length)
            except OSError as exc:
                raise TransferError(
                    f"cannot allocate {length} bytes in {shm_dir} ({exc.strerror}); "
                    "is the shared-memory mount big enough?"
                ) from exc
            mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            populate(mapping)
            os.rename(tmp, path)
        except BaseException:
            os.unlink(tmp)
            os.close(fd)
            raise
        self._fd = fd
        self._path = path
        # Unlink even if the owner forgets close() (runs at interpreter exit too).
        self._finalizer = weakref.finalize(self, _release_segment, path, fd)
        handle = MemoryRegionHandle(
            transport=ShmTransport.name,
            address=path,
            length=length,
            key=secrets.token_hex(16),
            layout=layout,
            region_id=region_id,
        )
        # The tensor keeps the mapping alive; the mmap is never closed by hand because
        # closing it under live tensor views would leave them dangling.
        super().__init__(handle, torch.frombuffer(mapping, dtype=torch.uint8))

    @property
    def path(self) -> str:
        return self._path

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unlink the segment and drop the lock; writers see the owner gone from now on."""
        self._finalizer()


class ShmWriter(QueuedWriter):
    """Copies ranges straight into a mapped segment owned by another process on this host."""

    accepts_device_tensors = True  # copy_ reads from any device

    def __init__(self, handle: MemoryRegionHandle, shm_dir: str) -> None:
        super().__init__(handle)
        path = handle.address
        name = os.path.basename(path)
        in_dir = os.path.normpath(os.path.dirname(path)) == os.path.normpath(shm_dir)
        if not in_dir or not name.startswith(SEGMENT_PREFIX):
            # A handle must not make us write into an arbitrary file.
            raise TransferError(f"shm handle address {path!r} is not a segment in {shm_dir}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise TransferError(f"cannot open shm segment {path}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != handle.length:
                raise TransferError(f"shm segment {path} has {size} bytes, handle {handle.length}")
            if not _owner_alive(fd):
                _unlink_if_same(path, fd)
                raise TransferError(f"owner of shm segment {path} is gone")
            # Not populated: a writer opens its mapping on a request's path (the first
            # transfer to this target), where populating a large pool would stall that
            # request; its first-touch faults land on the writer's core, spread over writes.
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._path = path
        self._dst = torch.frombuffer(mapping, dtype=torch.uint8)
        self._dst_bytes = np.frombuffer(mapping, dtype=np.uint8)
        layout = handle.layout
        self._dst_rows = self._dst_bytes[: layout.total_bytes].reshape(layout.num_layers, 2, -1)
        # The last source pool seen as rows: (tensor, its layout, its address, the array).
        self._src_rows: tuple[torch.Tensor, KVLayout, int, np.ndarray] | None = None
        self._owner_gone = False
        self._alive_checked = time.monotonic()
        self._start()

    def _check_alive(self) -> None:
        """Probe the owner unless the last probe is recent (``begin``, moves, ends)."""
        if self._owner_gone or time.monotonic() - self._alive_checked > _ALIVE_FOR_S:
            self._probe()

    def _probe(self) -> None:
        self._alive_checked = time.monotonic()
        if self._owner_gone or self._fd < 0:
            raise TransferError(f"owner of shm segment {self._path} is gone")
        try:
            alive = _owner_alive(self._fd)
        except OSError as exc:  # the writer was closed under us
            raise TransferError(f"writer to shm segment {self._path} is closed") from exc
        if not alive:
            self._owner_gone = True
            _unlink_if_same(self._path, self._fd)
            raise TransferError(f"owner of shm segment {self._path} is gone")

    def _move(self, job: QueuedJob, writes: Sequence[Write]) -> None:
        """Copy ``writes`` in order, from the source pool straight into the mapping.

        numpy does the copies: slices are bounds-checked (a bad one fails, it cannot write
        outside the buffer) and large copies run without the GIL, so the model's next
        layer keeps computing meanwhile. A ``write_blocks`` write is copied by run: one
        strided copy moves a run's keys and values in all the write's layers (one call
        instead of two per layer).
        """
        self._check_alive()
        for write in writes:
            plan = write.plan
            rows = self._rows(write) if plan is not None else None
            if rows is None:
                self._copy_ranges(job, write.src, write.ranges)
            else:
                assert plan is not None
                self._copy_runs(job, rows, plan, write.layer, write.stop)

    def _rows(self, write: Write) -> tuple[np.ndarray, np.ndarray] | None:
        """Source and destination pools as ``[layers, 2, row bytes]`` arrays for a planned
        write, or None if its source is not a CPU pool of the plan's layout."""
        plan, src = write.plan, write.src
        assert plan is not None
        layout = plan.src_layout
        cached = self._src_rows
        # The same pool as last time, at the same address (a view of memory the tensor let
        # go of must not be used): the common case, with one call into torch.
        if (
            cached is not None
            and cached[0] is src
            and cached[1] is layout
            and cached[2] == src.data_ptr()
        ):
            return cached[3], self._dst_rows
        if src.device.type != "cpu" or src.numel() < layout.total_bytes:
            return None
        address = src.data_ptr()
        view = src.detach().numpy()[: layout.total_bytes].reshape(layout.num_layers, 2, -1)
        self._src_rows = (src, layout, address, view)
        return view, self._dst_rows

    def _copy_runs(
        self,
        job: QueuedJob,
        rows: tuple[np.ndarray, np.ndarray],
        plan: BlockPlan,
        start: int,
        stop: int,
    ) -> None:
        """Copy ``plan``'s runs of layers ``[start, stop)``, at most about ``_COPY_CHUNK``
        bytes a call (whole layers), checking for an abort or the deadline before the first
        call and then every ``_COPY_CHUNK`` bytes (not between a small request's runs)."""
        src_rows, dst_rows = rows
        moved, check_at = 0, 0
        try:
            for s, d, n in plan.runs:
                per_call = max(1, _COPY_CHUNK // (2 * n))
                for a in range(start, stop, per_call):
                    if moved >= check_at:
                        if self._stop_copying(job, moved):
                            return
                        check_at = moved + _COPY_CHUNK
                    b = min(stop, a + per_call)
                    np.copyto(dst_rows[a:b, :, d : d + n], src_rows[a:b, :, s : s + n])
                    moved += (b - a) * 2 * n
        finally:
            self._moved(job, moved)

    def _copy_ranges(self, job: QueuedJob, src: torch.Tensor, ranges: Sequence[ByteRange]) -> None:
        """Copy explicit ranges one by one, in pieces of at most ``_COPY_CHUNK`` bytes."""
        if src.device.type == "cpu":
            src_bytes, dst_bytes = src.detach().numpy(), self._dst_bytes

            def copy(s: int, d: int, n: int) -> None:
                dst_bytes[d : d + n] = src_bytes[s : s + n]

        else:
            dst = self._dst

            def copy(s: int, d: int, n: int) -> None:
                dst[d : d + n].copy_(src[s : s + n])

        moved, check_at = 0, 0
        try:
            for s, d, n in ranges:
                done = 0
                while done < n:
                    if moved >= check_at:
                        if self._stop_copying(job, moved):
                            return
                        check_at = moved + _COPY_CHUNK
                    step = min(_COPY_CHUNK, n - done)
                    copy(s + done, d + done, step)
                    done += step
                    moved += step
        finally:
            self._moved(job, moved)

    def _stop_copying(self, job: QueuedJob, moving: int) -> bool:
        """True if ``job`` was aborted; ``TransferTimeout`` past its deadline (``moving``:
        bytes copied by the caller but not yet counted, for the message)."""
        if job.terminal:
            return True  # nothing is half-sent in a one-sided copy
        if time.monotonic() > job.deadline:
            raise self._timeout(job, moving)
        return False

    def _end(self, job: QueuedJob) -> None:
        self._check_alive()
        self._complete(job)

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShmTransport(Transport):
    """``shm``: regions in ``shm_dir`` (tmpfs, same host); writers copy straight into them."""

    name = "shm"

    def __init__(self, shm_dir: str = "/dev/shm", *, mode: int = 0o600) -> None:
        super().__init__()
        if not os.path.isdir(shm_dir):
            raise TransferError(f"shared-memory directory {shm_dir} does not exist")
        self.shm_dir = shm_dir
        self.mode = mode

    def _register(self, layout: KVLayout) -> KVRegion:
        return ShmRegion(layout, self.shm_dir, self.mode)

    def _open_writer(self, handle: MemoryRegionHandle) -> ShmWriter:
        return ShmWriter(handle, self.shm_dir)

"""Same-host transport: the target's KV pool lives in a POSIX shared-memory segment.

The target creates ``<shm_dir>/pdserve-kv-<random>`` (tmpfs; ``posix_fallocate`` claims the
pages up front so a full ``/dev/shm`` fails here with a clear error, not with SIGBUS later),
maps it and builds its pool on the mapping. A writer maps the same segment and its owner
thread copies each job's layers straight into it (numpy, without the GIL; one strided call
moves a block run over many layers): no intermediate buffer, and no acknowledgement, since
the copy *is* the delivery.

Liveness without a connection: the owner holds an exclusive ``flock`` on the segment for its
whole life; the kernel drops it when the owner exits, even on SIGKILL. A writer probes with a
non-blocking shared lock when a job starts: if it gets the lock the owner is gone, the job
fails with ``TransferError``, and the writer unlinks the orphaned segment. An owner that dies
during a job is the decode worker that asked for it: the cancelled call tells the prefill
worker, which aborts the job.
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

import numpy as np
import torch

from transfer.base import KVRegion, KVSource, Transport
from transfer.errors import TransferError
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.writer import JobWork, OwnerThreadWriter

SEGMENT_PREFIX = "pdserve-kv-"
# Copies are split so a deadline or an abort is noticed within a few milliseconds.
_COPY_CHUNK = 8 << 20


# madvise(MADV_POPULATE_WRITE), Linux 5.14+ (Python's mmap module has no name for it).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE = mmap.PAGESIZE


def populate(mapping: mmap.mmap) -> None:
    """Map every page of ``mapping`` into this process now, without changing its bytes.

    A fresh mapping faults on each page's first touch; left to the first decode step that
    reads a newly arrived request's KV, that stalls every stream in the batch (measured in
    docs/benchmarks.md). So the owner populates its mapping once, at registration."""
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


class ShmWriter(OwnerThreadWriter):
    """Copies a job's layers straight into a mapped segment owned by another process on this
    host, on the writer's owner thread: the copy *is* the delivery, nothing to confirm."""

    def __init__(self, handle: MemoryRegionHandle, source: KVSource, shm_dir: str) -> None:
        if source.tensor.device.type != "cpu":
            raise TransferError(f"shm copies from host memory, not {source.tensor.device}")
        super().__init__(handle, source)
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
            # Not populated here (unlike the owner's): populating a large pool would stall
            # the request that opened the writer; first touches spread over its copies.
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._path = path
        # Both pools as [layers, 2, row bytes]: a run of many layers is one strided copy.
        dst = np.frombuffer(mapping, dtype=np.uint8)[: handle.layout.total_bytes]
        self._dst_rows = dst.reshape(handle.layout.num_layers, 2, -1)
        src = source.tensor.numpy()[: source.layout.total_bytes]
        self._src_rows = src.reshape(source.layout.num_layers, 2, -1)
        self._launch()

    def _start(self, work: JobWork) -> None:
        if not _owner_alive(self._fd):
            _unlink_if_same(self._path, self._fd)
            self._retire()  # its memory goes back to the system once nobody maps it
            raise TransferError(f"owner of shm segment {self._path} is gone")

    def _move(self) -> None:
        self._copy_pending(self._copy)

    def _copy(self, work: JobWork, start: int, stop: int) -> None:
        """Copy layers ``[start, stop)`` of ``work``, run by run, in pieces of about
        ``_COPY_CHUNK`` bytes; between pieces take messages and check the deadline, so an
        abort or a timeout stops a long copy within a piece."""
        for s, d, n in work.job.blocks.runs:
            per_piece = max(1, _COPY_CHUNK // (2 * n))
            for a in range(start, stop, per_piece):
                b = min(stop, a + per_piece)
                np.copyto(self._dst_rows[a:b, :, d : d + n], self._src_rows[a:b, :, s : s + n])
                self._landed(work, (b - a) * 2 * n)
                self._take_messages()
                if work.done:
                    return
                if time.monotonic() > work.job.deadline:
                    self._fail(work, self._timeout(work))
                    return
        self._moved(work, start, stop)

    def _end(self, work: JobWork) -> None:
        self._succeed(work)  # the copy is the delivery

    def _release(self) -> None:
        os.close(self._fd)
        del self._dst_rows  # the last reference to the mapping: unmapped when collected


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

    def _open_writer(self, handle: MemoryRegionHandle, source: KVSource) -> ShmWriter:
        return ShmWriter(handle, source, self.shm_dir)

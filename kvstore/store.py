"""One engine process's side of the KV store: full blocks out (off the token path), prefix
blocks in (checked before use).

Write path (``offer``, engine thread -> copier thread -> putter thread -> store):
  offered  --a free slot of the write buffer, or the block is dropped and counted-->
  queued   --(engine thread: no bytes move; the caller holds the block so they stay put)-->
  copied   --copier thread: pool block -> write buffer slot, then ``release_blocks``-->
  stored   --putter thread: skip what the store already has, put the rest
The engine never waits for the store and never copies for it: what ``offer`` costs the
engine thread is a lookup, a slot and a queue entry per block. Holds last only as long as a
memcpy (the copier never waits on the store); when the buffer is full (the store is slow or
down), blocks are dropped, never queued without bound.

Read path (``present_run`` then ``load``, a loader thread): how many leading blocks of a
chain the store holds, then read them into the load buffer, check each object's size and
header (``kvstore.block_format``), and copy the good ones into the pool's blocks the
caller claimed. The first block missing or wrong ends the run: a prefix is only usable up
to its first hole; the hash of that hole is remembered as ``missing`` (the worker tells the
scheduler, whose index of the store then forgets it).

Threads: every thread here (copier, putter, loaders) runs on ``cpus`` when given: a decode
worker keeps its store off its engine's core (``services.common.kv_store``).

``known`` remembers hashes this process stored or loaded recently (``KNOWN_FOR_S``), so a
turn that finishes with blocks the store already holds copies nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from engine.async_engine import AsyncEngine
from engine.kv_cache import KVCache
from engine.threads import name_current_thread, pin_current_thread
from kvstore.backend import StoreBackend
from kvstore.block_format import HEADER_BYTES, BlockFormat, BlockMismatch

log = structlog.get_logger(__name__)

KNOWN_FOR_S = 60.0
# A put the store refuses (its pool full until it evicts, or offloads to SSD first) is tried
# again this often, this many times in all, while its block waits in the write buffer.
PUT_ATTEMPTS = 4
PUT_RETRY_S = 0.5
_KNOWN_MAX = 1 << 18
_PUT_BATCH = 64
_STOP = object()


@dataclass
class StoreStats:
    """Counters since start; each field has one writer (the thread named beside it)."""

    offered_blocks: int = 0  # engine
    dropped_blocks: int = 0  # engine: the write buffer was full
    offer_seconds_total: float = 0.0  # engine: time spent in offer
    copied_blocks: int = 0  # copier
    stored_blocks: int = 0  # putter
    stored_bytes: int = 0  # putter
    already_stored_blocks: int = 0  # putter: the store had them (another worker's)
    failed_puts: int = 0  # putter: the store refused or failed
    lookups: int = 0  # loader
    hit_blocks: int = 0  # loader: blocks loaded and checked
    loaded_bytes: int = 0  # loader
    load_seconds_total: float = 0.0  # loader
    loads: int = 0  # loader
    missing_blocks: int = 0  # loader: said present, then not readable
    absent_blocks: int = 0  # loader: a lookup's run ended before the chain did
    refused_blocks: int = 0  # loader: wrong size or header (never used)


class KVStore:
    """Moves one pool's full blocks to and from a ``StoreBackend`` in ``fmt``'s objects."""

    def __init__(
        self,
        backend: StoreBackend,
        fmt: BlockFormat,
        *,
        write_buffer_bytes: int = 128 << 20,
        load_buffer_bytes: int = 32 << 20,
        release_blocks: Callable[[Sequence[int]], None] | None = None,
        cpus: frozenset[int] | None = None,
        start: bool = True,
    ) -> None:
        """``release_blocks(ids)``: called from the copier once it copied blocks ``offer``
        queued (the caller's hold on them may end; None: nothing to release). ``cpus``:
        the cores this store's threads run on (None: wherever the process may run).
        ``start=False``: the threads wait for ``start()`` (blocks offered meanwhile fill the
        write buffer, then are dropped)."""
        self.backend = backend
        self.fmt = fmt
        self.stats = StoreStats()
        self.cpus = cpus
        self.release_blocks = release_blocks
        obj = fmt.object_bytes
        self._write_slots = max(1, write_buffer_bytes // obj)
        self._load_slots = max(1, load_buffer_bytes // obj)
        self._write_buf = torch.empty(self._write_slots * obj, dtype=torch.uint8)
        self._load_buf = torch.empty(self._load_slots * obj, dtype=torch.uint8)
        backend.register(self._write_buf.data_ptr(), self._write_buf.numel())
        backend.register(self._load_buf.data_ptr(), self._load_buf.numel())
        self._free = list(range(self._write_slots))
        self._free_lock = threading.Lock()
        self._offered: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._known: OrderedDict[int, float] = OrderedDict()
        self._known_lock = threading.Lock()
        # Hashes confirmed in the store, and hashes a lookup found missing, since the last
        # drain (the worker's heartbeat tells the scheduler); bounded: the oldest go first.
        self._confirmed: deque[int] = deque(maxlen=_KNOWN_MAX)
        self._missing: deque[int] = deque(maxlen=_KNOWN_MAX)
        self._load_lock = threading.Lock()
        self.loader = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kv-store-load", initializer=self._pin
        )
        self._copier = threading.Thread(
            target=self._pinned, args=(self._copy_loop,), name="kv-store-copy", daemon=True
        )
        self._writer = threading.Thread(
            target=self._pinned, args=(self._write_loop,), name="kv-store-put", daemon=True
        )
        if start:
            self.start()

    def start(self) -> None:
        self._copier.start()
        self._writer.start()

    def _pin(self) -> None:
        if self.cpus is None:
            return
        try:
            pin_current_thread(self.cpus)
        except OSError as e:  # the thread runs where the process may: slower, not wrong
            log.warning("kv_store_cpus_refused", cpus=sorted(self.cpus), error=str(e))

    def _pinned(self, loop: Callable[[], None]) -> None:
        self._pin()
        name_current_thread(threading.current_thread().name)
        loop()

    # -- write path ------------------------------------------------------------------
    def offer(
        self, kv: KVCache, block_hashes: Sequence[int], block_ids: Sequence[int]
    ) -> list[int]:
        """Engine thread: queue the blocks the store may lack; never blocks on the store and
        copies nothing. Returns the ids queued: the caller keeps each one's bytes unchanged
        (holds it) until ``release_blocks`` names it. Once the buffer is full, this and the
        rest of the chain are dropped (a later block is useless to a prefix load without
        this one)."""
        t0 = time.monotonic()  # the clock ``_known`` keeps
        queued: list[int] = []
        for i, (block_hash, block_id) in enumerate(zip(block_hashes, block_ids, strict=True)):
            self.stats.offered_blocks += 1
            if self._is_known(block_hash, t0):
                continue
            with self._free_lock:
                slot = self._free.pop() if self._free else None
            if slot is None:
                dropped = len(block_ids) - i
                self.stats.dropped_blocks += dropped
                self.stats.offered_blocks += dropped - 1
                break
            self._offered.put((kv, block_hash, block_id, slot))
            queued.append(block_id)
        self.stats.offer_seconds_total += time.monotonic() - t0
        return queued

    def _copy_loop(self) -> None:
        """Copy what ``offer`` queued into its slots, release the blocks, pass the slots on
        to the putter. Never waits on the store, so a hold lasts a memcpy."""
        while True:
            items = [self._offered.get()]
            while True:
                try:
                    items.append(self._offered.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in items)
            work = [item for item in items if item is not _STOP]
            for kv, block_hash, block_id, slot in work:
                self._fill(slot, kv, block_hash, block_id)
            self.stats.copied_blocks += len(work)
            if work and self.release_blocks is not None:
                try:
                    self.release_blocks([block_id for _, _, block_id, _ in work])
                except Exception:
                    log.warning("kv_store_release_failed", exc_info=True)
            for _, block_hash, _, slot in work:
                self._queue.put((block_hash, slot))
            if stop:
                self._queue.put(_STOP)
                return

    def _fill(self, slot: int, kv: KVCache, block_hash: int, block_id: int) -> None:
        obj = self._object(self._write_buf, slot)
        obj[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(self.fmt.header(block_hash)),
                                                  dtype=torch.uint8))  # fmt: skip
        self._payload(obj, kv).copy_(kv.pool[:, :, block_id])

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            while len(batch) < _PUT_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queue.put(_STOP)
                    break
                batch.append(item)
            try:
                for attempt in range(PUT_ATTEMPTS):
                    if attempt:
                        time.sleep(PUT_RETRY_S)
                    batch = self._put(batch, last=attempt == PUT_ATTEMPTS - 1)
                    if not batch:
                        break
            except Exception:
                self.stats.failed_puts += len(batch)
                log.warning("kv_store_put_failed", blocks=len(batch), exc_info=True)
            finally:
                with self._free_lock:
                    self._free.extend(slot for _, slot in batch)

    def _put(self, batch: list[tuple[int, int]], *, last: bool) -> list[tuple[int, int]]:
        """Put what the store lacks; returns the blocks it refused (counted on the ``last``
        attempt), whose slots the caller still holds."""
        keys = [self.fmt.key(h) for h, _ in batch]
        there = self.backend.exists(keys)
        todo = [(k, h, s) for k, (h, s), t in zip(keys, batch, there, strict=True) if not t]
        self.stats.already_stored_blocks += len(batch) - len(todo)
        self._remember(h for (h, _), t in zip(batch, there, strict=True) if t)
        done = [slot for (_, slot), t in zip(batch, there, strict=True) if t]
        if not todo:
            self._release(done)
            return []
        obj = self.fmt.object_bytes
        base = self._write_buf.data_ptr()
        ok = self.backend.put_from([k for k, _, _ in todo], [base + s * obj for _, _, s in todo],
                                   obj)  # fmt: skip
        stored = [h for (_, h, _), good in zip(todo, ok, strict=True) if good]
        self.stats.stored_blocks += len(stored)
        self.stats.stored_bytes += len(stored) * obj
        self._remember(stored)
        refused = [(h, s) for (_, h, s), good in zip(todo, ok, strict=True) if not good]
        if last:
            self.stats.failed_puts += len(refused)
        # Last: an exception before this leaves every slot to the caller to free, once.
        self._release(done + [s for (_, _, s), good in zip(todo, ok, strict=True) if good])
        return refused

    def _release(self, slots: list[int]) -> None:
        with self._free_lock:
            self._free.extend(slots)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued block was put (or failed); False on timeout. For tests
        and shutdown: the serving path never waits on the writer."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._free_lock:
                if len(self._free) == self._write_slots:
                    return True
            time.sleep(0.005)
        return False

    # -- read path -------------------------------------------------------------------
    def present_run(self, block_hashes: Sequence[int]) -> int:
        """Loader thread: how many leading ``block_hashes`` the store holds now."""
        self.stats.lookups += 1
        if not block_hashes:
            return 0
        n = 0
        for there in self.backend.exists([self.fmt.key(h) for h in block_hashes]):
            if not there:
                break
            n += 1
        if n < len(block_hashes):
            self.stats.absent_blocks += 1
            self._note_missing(block_hashes[n:])
        return n

    def load(self, kv: KVCache, block_hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        """Loader thread: read the blocks ``block_hashes`` name into ``block_ids`` of ``kv``
        (blocks nobody else touches meanwhile); returns how many leading ones now hold their
        KV. A block that is missing, of the wrong size or header ends the run; its bytes
        and every later block's are garbage (the caller never commits them)."""
        t0 = time.monotonic()
        done = 0
        with self._load_lock:
            obj = self.fmt.object_bytes
            base = self._load_buf.data_ptr()
            while done < len(block_hashes):
                hashes = block_hashes[done : done + self._load_slots]
                keys = [self.fmt.key(h) for h in hashes]
                sizes = self.backend.get_into(keys, [base + i * obj for i in range(len(keys))], obj)
                good = 0
                for i, (block_hash, size) in enumerate(zip(hashes, sizes, strict=True)):
                    if not self._check(self._object(self._load_buf, i), block_hash, size):
                        break
                    good += 1
                for i in range(good):
                    payload = self._payload(self._object(self._load_buf, i), kv)
                    kv.pool[:, :, block_ids[done + i]].copy_(payload)
                self._remember(hashes[:good])
                done += good
                if good < len(hashes):
                    self._note_missing(block_hashes[done:])
                    break
        seconds = time.monotonic() - t0
        self.stats.loads += 1
        self.stats.hit_blocks += done
        self.stats.loaded_bytes += done * self.fmt.object_bytes
        self.stats.load_seconds_total += seconds
        return done

    def _check(self, obj: torch.Tensor, block_hash: int, size: int) -> bool:
        if size < 0:
            self.stats.missing_blocks += 1
            return False
        try:
            self.fmt.check(obj[:HEADER_BYTES].numpy().tobytes(), block_hash, size)
        except BlockMismatch as e:
            self.stats.refused_blocks += 1
            log.error("kv_store_block_refused", key=self.fmt.key(block_hash), reason=str(e))
            return False
        return True

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        """Run a read-path call on a loader thread."""
        return self.loader.submit(fn, *args)

    # -- shared ----------------------------------------------------------------------
    def _object(self, buf: torch.Tensor, slot: int) -> torch.Tensor:
        obj = self.fmt.object_bytes
        return buf[slot * obj : (slot + 1) * obj]

    def _payload(self, obj: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """An object's payload viewed as one block of ``kv``: ``[layers, 2, block, heads,
        dim]``, the shape ``kv.pool[:, :, block_id]`` has."""
        spec = kv.spec
        shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return obj[HEADER_BYTES:].view(spec.dtype).view(shape)

    def _is_known(self, block_hash: int, now: float) -> bool:
        with self._known_lock:
            seen = self._known.get(block_hash)
        return seen is not None and now - seen < KNOWN_FOR_S

    def drain_confirmed(self) -> list[int]:
        """The hashes confirmed in the store (put, found, loaded) since the last call."""
        return _drain(self._confirmed)

    def drain_missing(self) -> list[int]:
        """The hashes a lookup or load found missing from the store since the last call
        (each the first hole of a chain asked for)."""
        return _drain(self._missing)

    def _note_missing(self, chain: Sequence[int]) -> None:
        """The store lacks ``chain[0]`` (evicted, or never put), so the rest of the chain is
        no use in it either: report the hole, and offer the whole rest again when it is
        computed again."""
        self._missing.append(chain[0])
        with self._known_lock:
            for block_hash in chain:
                self._known.pop(block_hash, None)

    def _remember(self, block_hashes: Any) -> None:
        now = time.monotonic()
        with self._known_lock:
            for block_hash in block_hashes:
                self._known[block_hash] = now
                self._known.move_to_end(block_hash)
                self._confirmed.append(block_hash)
            while len(self._known) > _KNOWN_MAX:
                self._known.popitem(last=False)

    def close(self) -> None:
        """Stop the copier and putter (queued blocks are put first) and the loaders, then
        the backend."""
        self._offered.put(_STOP)
        for thread in (self._copier, self._writer):
            if thread.is_alive():
                thread.join(timeout=10.0)
        self.loader.shutdown(wait=True, cancel_futures=True)
        self.backend.close()


async def export_to(aengine: AsyncEngine, store: KVStore | None) -> None:
    """From now on the full blocks ``aengine``'s engine computes go to ``store`` (None: to
    nowhere). The engine thread queues and holds them (``LLMEngine.kv_export``); the copier
    drops each hold through the engine's command queue once it copied the block."""
    eng = aengine.engine
    if store is None:
        await aengine.call(lambda: setattr(eng, "kv_export", None))
        return

    def export(block_hashes: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        return store.offer(eng.kv, block_hashes, block_ids)

    def release(block_ids: Sequence[int]) -> None:
        held = list(block_ids)
        aengine.submit(lambda: eng.free_blocks(held))

    store.release_blocks = release
    await aengine.call(lambda: setattr(eng, "kv_export", export))


def _drain(items: deque[int]) -> list[int]:
    """Pop every item of ``items`` (another thread may append meanwhile)."""
    out = []
    while items:
        try:
            out.append(items.popleft())
        except IndexError:
            break
    return out

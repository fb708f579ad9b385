"""A target (decode-side) process for transfer tests, and the byte patterns both sides use.

The target registers a region, fills it with a seeded pattern, sends its handle to the
parent, then answers ``verify`` by rebuilding the expected pool on its own (block indexing on
a ``[layers, 2, blocks, block_bytes]`` view, not the library's offset math) and counting the
bytes that differ.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from transfer import (
    KVLayout,
    KVSource,
    MemoryRegionHandle,
    RegionWriter,
    TransferResult,
    get_transport,
)
from transfer.shm import sweep_stale_segments

DST_SEED = 7
SRC_SEED = 11
# The scenario both transports run: 2 requests, 3 of 4 layers, one merged and one split run.
SRC_LAYOUT = KVLayout(
    num_layers=4, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32"
)
DST_LAYOUT = KVLayout(
    num_layers=4, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32"
)
MOVES = [([0, 1, 2], [5, 6, 7]), ([3, 4], [10, 2])]
LAYERS = [0, 1, 2]
# bytes per request: blocks x (keys + values) x layers x block bytes
MOVE_BYTES = [len(src) * 2 * len(LAYERS) * SRC_LAYOUT.block_bytes for src, _ in MOVES]


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def blocks_view(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    return pool.view(layout.num_layers, 2, layout.num_blocks, layout.block_bytes)


def expected_pool(
    dst_layout: KVLayout,
    src_layout: KVLayout,
    moves: Sequence[tuple[Sequence[int], Sequence[int]]],
    layers: Sequence[int],
) -> torch.Tensor:
    """The destination after copying ``src ids -> dst ids`` of ``layers`` for each move."""
    dst = pattern(dst_layout.total_bytes, DST_SEED)
    src = blocks_view(pattern(src_layout.total_bytes, SRC_SEED), src_layout)
    dst_blocks = blocks_view(dst, dst_layout)
    for src_ids, dst_ids in moves:
        for layer in layers:
            for s, d in zip(src_ids, dst_ids, strict=True):
                dst_blocks[layer, :, d] = src[layer, :, s]
    return dst


def source(layout: KVLayout = SRC_LAYOUT, seed: int = SRC_SEED) -> KVSource:
    """A source pool of ``layout`` filled with the seeded pattern."""
    return KVSource(pattern(layout.total_bytes, seed), layout)


def push_requests(
    writer: RegionWriter, *, timeout: float = 10.0, moves: list | None = None
) -> list[TransferResult]:
    """Write ``moves`` (default ``MOVES``) layer by layer, interleaved like a batched prefill;
    the results in order (the first failure raises)."""
    moves = MOVES if moves is None else moves
    deadline = time.monotonic() + timeout
    jobs = [
        writer.begin(f"req-{i}", src_ids, dst_ids, deadline=deadline)
        for i, (src_ids, dst_ids) in enumerate(moves)
    ]
    for layer in LAYERS:
        for job in jobs:
            job.write_layer(layer)
    return [job.finish().result(timeout + 5) for job in jobs]


def assert_pushed(writer: RegionWriter, target: Target, results: list[TransferResult]) -> None:
    """``push_requests(writer)``'s ``results`` and ``target``'s pool agree with ``MOVES``:
    both requests landed exactly where they belong (the check can fail: without the second
    request's blocks the pools differ), and the writer counted them."""
    assert [r.bytes for r in results] == MOVE_BYTES
    assert [r.layers for r in results] == [3, 3]
    assert target.verify(SRC_LAYOUT, MOVES, LAYERS) == 0
    assert target.verify(SRC_LAYOUT, MOVES[:1], LAYERS) > 0
    sent = writer.stats()
    assert (sent.bytes, sent.jobs, sent.failures) == (sum(MOVE_BYTES), 2, 0)


def closed_by_peer(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the peer closes ``sock`` within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def serve(conn: Connection, transport: str, opts: dict[str, Any], layout: dict) -> None:
    """Target main: register, send the handle, then serve verify/close requests."""
    torch.set_num_threads(1)
    kv_layout = KVLayout.from_dict(layout)
    with get_transport(transport, **opts) as tp:
        region = tp.register(kv_layout)
        region.tensor.copy_(pattern(kv_layout.total_bytes, DST_SEED))
        conn.send((os.getpid(), region.handle.to_dict()))
        while True:
            message = conn.recv()
            if message[0] == "verify":
                _, src_layout, moves, layers = message
                want = expected_pool(kv_layout, KVLayout.from_dict(src_layout), moves, layers)
                conn.send(int((region.tensor.cpu() != want).sum()))
            elif message[0] == "stats":
                conn.send(region.stats())
            elif message[0] == "close":
                region.close()
                conn.send("closed")
                return


class Target:
    """Parent-side handle on a target process (spawned: nothing inherited by fork)."""

    def __init__(self, transport: str, layout: KVLayout, **opts: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child, transport, opts, layout.to_dict()), daemon=True
        )
        self.process.start()
        child.close()
        pid, handle = self._recv(60.0)
        self.pid: int = pid
        self.handle = MemoryRegionHandle.from_dict(handle)

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError("target process did not answer")
        return self._conn.recv()

    def verify(self, src_layout: KVLayout, moves: list, layers: Sequence[int]) -> int:
        """Number of destination bytes that differ from the expected pool."""
        self._conn.send(("verify", src_layout.to_dict(), moves, list(layers)))
        return self._recv(30.0)

    def stats(self) -> Any:
        self._conn.send(("stats",))
        return self._recv(10.0)

    def close(self) -> None:
        self._conn.send(("close",))
        assert self._recv(10.0) == "closed"
        self.process.join(10.0)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10.0)

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP the target and return once the kernel reports it stopped: the signal is
        delivered asynchronously, and a target still running for a millisecond could take
        and acknowledge a small transfer sent right after ``os.kill`` returned."""
        os.kill(self.pid, signal.SIGSTOP)
        assert wait_until(lambda: _state(self.pid) in ("T", "t"), timeout), "target did not stop"

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.is_alive():
            self.resume()
            self.kill()
        self._conn.close()
        if self.handle.transport == "shm":
            sweep_stale_segments()  # a killed target cannot unlink its own segment


def wait_until(predicate: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _state(pid: int) -> str:
    """The process state letter from ``/proc/<pid>/stat`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]

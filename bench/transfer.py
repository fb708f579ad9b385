"""KV transfer benchmark: the shm, tcp and mooncake data planes beside raw memcpy and a raw
socket, and the per-token latency the serving hop adds over the in-process engine.

Transfer (one request's KV in SmolLM2-135M's real layout: 30 layers, 3 KV heads, head dim 64,
float32, 16-token blocks; 46,080 bytes a token). Four peer processes are spawned and stay up
for the whole run: an ``shm``, a ``tcp`` and a ``mooncake`` target (each registers a region,
like a decode worker; mooncake's with protocol ``tcp``) and a raw socket sink. Without
Mooncake's Transfer Engine installed the mooncake method is skipped and the reason printed.
This process holds the source pool. For each size, the request's source blocks are
consecutive (a fresh allocation on a prefill worker) and its destination blocks come in runs
of 1 to 16 at scattered places (a decode pool fragmented by churn), so each layer is
``2 x runs`` byte ranges. Every repeat runs each of these once, in an order shuffled every
round (a fixed order can phase-lock with a periodic disturbance):

- ``memcpy bulk``: one memcpy of the request's byte volume between two buffers here;
- ``memcpy``: one memcpy per range a transport moves, between two buffers here (the
  reference ``shm`` is judged against). Each memcpy is a memoryview slice assignment, the
  cheapest per-call way Python has to run libc's memcpy (docs/benchmarks.md compares it with
  ctypes.memmove and torch ``copy_``), so the ratio is the transport's own overhead on top
  of the copies themselves;
- ``shm`` / ``tcp`` / ``mooncake``: ``begin`` (which plans the block runs once) ->
  ``write_layer`` for all 30 layers -> ``finish``, timed from ``begin`` to the outcome in
  hand (the writer's owner thread moves the bytes, or submits mooncake's writes, and
  resolves it); ``wait`` is ``TransferResult.wait_seconds``, from ``finish`` to the
  confirmation;
- ``socket``: a plain blocking TCP loopback socket: a 16-byte header, then one ``sendall`` per
  range (the same chunking), the sink ``recv_into``s a preallocated buffer and acknowledges;
  timed to the acknowledgement (the reference ``tcp`` is judged against).

Every method's bytes are checked after its timed repeats (per-block sums at the destination
equal the source's). Torch runs one thread in every process: each method copies on one core.
With 2+ cores this process (with its Transfer Engine's threads) runs on the first and the
four peers on the second (``--no-transfer-pin`` leaves them floating): the socket sender and
its sink, and a transport's writer and its receiver, never take turns on one core (on 2
cores that made the small sizes' medians swing from run to run).
Every connection (the raw socket's, tcp's, Mooncake's) sends with the host's TCP congestion
control.
A size's rounds (``--repeats``) come in ``--passes`` visits (default 5), the sizes taking
turns, each visit after one untimed call of every method: a disturbance lasting a second or
two, longer than all of a small size's rounds take, then lands in one visit's share of any
size's samples (and in its P99), not in all of them (and its median).
Throughput is bytes / median latency. Targets: shm >= 80% of memcpy, tcp >= 70% of the raw
socket, at every size. Issue 35's rule for retiring tcp: mooncake over TCP at >= 80% of tcp's
throughput at every size from 512 tokens, and the fence holding (a failed job is quiet only
when no write of it can still land; tests/transfer/test_mooncake.py checks that, this does
not); otherwise both stay. The throughput table gives mooncake / tcp per size, and a verdict
line follows it.

Hop (the gateway -> decode path against the in-process engine): the same greedy request
(random prompt, ``ignore_eos``, ``--hop-tokens`` tokens) streamed (a) from an
``AsyncEngine`` in this process, (b) from a colocated decode worker process over
``DecodeWorker.Generate`` (grpc.aio client here), and (c) through ``pdserve up --colocated``
(redis, scheduler, worker, gateway) over ``Gateway.Generate`` when the gateway has
``--backend cluster``. Every engine runs one torch thread; pinned (the default with 2+
cores), every engine thread computes on the second core, and the worker processes' other
threads may also use the first, the layout ``pdserve up --pin --control-cpus`` gives
(``--hop-whole-pin`` adds a reference row: a worker whose every thread is on the engine
core). Requests alternate between the paths, repeat after repeat, so drift hits all of them
alike. Inter-token gaps are taken at the consumer (the first event, which carries the
prefill, is excluded; an event with k tokens gives k gaps of 1/k of its gap). The latency a
path adds is measured per event: every DecodeEvent/GenerateEvent carries the decode worker's
``produced_unix_ns`` stamp, and the client subtracts it from its own receive time (one host,
one clock): the delay from the worker handing the tokens to its stream to the client holding
them. The in-process engine consumes its events where they are produced: its delay is the
baseline, zero. Target: P99 of that delay <= 2 ms per token. The ITL difference to the
in-process engine is reported too, for reference only: it mixes each path's step-time jitter
in and moves by several ms on a shared machine.

``python -m bench.transfer --help`` lists the options; ``--json OUT`` writes every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from bench._common import (
    load_average,
    machine_info,
    markdown_table,
    percentile,
    pinned,
    ratio,
    write_json,
)
from services.up import worker_placement
from transfer import (
    ByteRange,
    KVLayout,
    KVSource,
    MemoryRegionHandle,
    TransferError,
    Transport,
    block_runs,
    get_transport,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

# SmolLM2-135M's KV layout (see /work/shared/MACHINE.md): 46,080 bytes a token in float32.
NUM_LAYERS = 30
NUM_KV_HEADS = 3
HEAD_DIM = 64
BLOCK_SIZE = 16
DTYPE = "float32"
BYTES_PER_TOKEN = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4

SHM_TARGET = 0.80  # shm throughput / memcpy (same ranges)
TCP_TARGET = 0.70  # tcp throughput / raw loopback socket (same chunking)
HOP_TARGET_MS = 2.0  # P99 per-token delay the serving path adds (worker stamp -> client)
# Issue 35: tcp may retire once mooncake (protocol tcp) reaches this share of tcp's throughput
# at every size from MOONCAKE_FROM_TOKENS tokens (and the fence holds: not measured here).
MOONCAKE_KEEP = 0.80
MOONCAKE_FROM_TOKENS = 512

MAX_RUN_BLOCKS = 16  # destination runs are 1..16 blocks long
DEADLINE_S = 60.0
HOP_KV_MIB = 128
HOP_PROMPT_TOKENS = 32
PEER_START_S = 120.0
SERVICE_START_S = 240.0

METHODS = ("memcpy_bulk", "memcpy", "shm", "socket", "tcp", "mooncake")
# Methods whose target process registers a region, and the options each side builds its
# transport with.
REGION_METHODS = ("shm", "tcp", "mooncake")
TRANSPORT_OPTS: dict[str, dict[str, Any]] = {
    "shm": {},
    "tcp": {},
    "mooncake": {"protocol": "tcp"},
}

DECODE_PATH = "decode worker gRPC"
WHOLE_PIN_PATH = "decode worker gRPC, whole process on the engine core"

_QUICK: dict[str, Any] = {
    "sizes": [128, 256],
    "repeats": 5,
    "passes": 1,
    "hop": False,
    "hop_tokens": 16,
    "hop_repeats": 2,
}
_DEFAULTS: dict[str, Any] = {
    "sizes": [128, 256, 512, 1024, 2048, 4096],
    "repeats": 100,
    "passes": 5,
    "hop": True,
    "hop_tokens": 64,
    "hop_repeats": 10,
}


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    sizes: tuple[int, ...]
    repeats: int  # timed rounds per size
    hop: bool
    hop_tokens: int
    hop_repeats: int
    gateway: bool
    seed: int
    hop_pin: bool = True  # engines on their own core; client, gateway, control on another
    transfer_pin: bool = True  # this process (the initiator) on one core, the peers on another
    # Hop: also stream from a decode worker pinned whole to the engine core (no
    # --engine-cpus), a reference row for what splitting its threads gains.
    hop_whole_pin: bool = False
    # A size's rounds come in this many visits, the sizes taking turns (see run_transfer).
    passes: int = 1

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("sizes must be non-empty token counts >= 1")
        for name in ("repeats", "hop_tokens", "hop_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.hop_tokens < 3:
            raise ValueError("hop_tokens must be >= 3 (two gaps at least)")
        if not 1 <= self.passes <= self.repeats:
            raise ValueError(f"passes must be in [1, repeats={self.repeats}], got {self.passes}")


# -- pure helpers ------------------------------------------------------------------------
def kv_layout(num_blocks: int) -> KVLayout:
    """SmolLM2's KV layout with a pool of ``num_blocks`` blocks."""
    return KVLayout(
        num_layers=NUM_LAYERS,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
    )


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def request_block_ids(
    num_blocks: int, src_pool: int, dst_pool: int, seed: int
) -> tuple[list[int], list[int]]:
    """Source and destination block ids of one request of ``num_blocks`` blocks.

    Source: consecutive ids at a seeded offset (a fresh allocation on a prefill worker).
    Destination: the pool cut into runs of 1..``MAX_RUN_BLOCKS`` consecutive ids, shuffled,
    taken in that order (a decode pool fragmented by churn). Deterministic in ``seed``.
    Raises ``ValueError`` when a pool is too small.
    """
    if num_blocks < 1 or num_blocks > src_pool or num_blocks > dst_pool:
        raise ValueError(f"{num_blocks} blocks do not fit pools of {src_pool} and {dst_pool}")
    rng = random.Random(seed)
    start = rng.randrange(src_pool - num_blocks + 1)
    src = list(range(start, start + num_blocks))
    runs: list[range] = []
    pos = 0
    while pos < dst_pool:
        length = min(rng.randint(1, MAX_RUN_BLOCKS), dst_pool - pos)
        runs.append(range(pos, pos + length))
        pos += length
    rng.shuffle(runs)
    dst: list[int] = []
    for run in runs:
        dst.extend(run[: num_blocks - len(dst)])
        if len(dst) == num_blocks:
            break
    return src, dst


def shuffled_rounds(names: Sequence[str], rounds: int, seed: int) -> list[list[str]]:
    """``rounds`` orders of ``names``, each a permutation drawn with ``seed``: every method
    runs once a round, in a fresh order (see ``TransferBench.run_size``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        out.append(order)
    return out


def per_token_gaps(arrivals: Sequence[tuple[float, int]]) -> list[float]:
    """Inter-token gaps (seconds) of one stream from ``(arrival time, tokens in event)``.

    Events without tokens are ignored; the first event with tokens (it carries the prefill)
    starts the clock; a later event with ``k`` tokens yields ``k`` gaps of ``gap / k``.
    """
    gaps: list[float] = []
    last: float | None = None
    for at, count in arrivals:
        if count <= 0:
            continue
        if last is not None:
            gaps.extend([(at - last) / count] * count)
        last = at
    return gaps


@dataclass(frozen=True)
class Summary:
    """P50 / P99 / mean of a non-empty sample (same unit as the samples)."""

    n: int
    p50: float
    p99: float
    mean: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        if not samples:
            raise ValueError("summary of an empty sample")
        return cls(
            n=len(samples),
            p50=percentile(samples, 50.0),
            p99=percentile(samples, 99.0),
            mean=sum(samples) / len(samples),
        )


def added(path: Summary, base: Summary) -> tuple[float, float]:
    """What a path adds over the base, per percentile: ``(P50 diff, P99 diff)``."""
    return path.p50 - base.p50, path.p99 - base.p99


def tcp_retirement(
    ratios: Sequence[tuple[int, float | None]], skipped: str | None = None
) -> tuple[bool | None, str]:
    """Issue 35's rule on one run's ``(tokens, mooncake / tcp throughput)`` per size:
    ``(True, line)`` when mooncake reaches ``MOONCAKE_KEEP`` at every size from
    ``MOONCAKE_FROM_TOKENS`` (tcp may go if the fence holds too), ``(False, line)`` when it
    misses at one of them (both stay), ``(None, line)`` when the run cannot tell (mooncake
    ``skipped`` for that reason, or no size from ``MOONCAKE_FROM_TOKENS``)."""
    rule = f"mooncake ≥ {MOONCAKE_KEEP:.2f}× tcp at every size from {MOONCAKE_FROM_TOKENS} tokens"
    if skipped is not None:
        return None, f"{rule}: no verdict, mooncake did not run ({skipped})"
    judged = [(t, r) for t, r in ratios if t >= MOONCAKE_FROM_TOKENS and r is not None]
    if not judged:
        return None, f"{rule}: no verdict, this run has no such size (--sizes)"
    tokens, low = min(judged, key=lambda tr: tr[1])
    if low >= MOONCAKE_KEEP:
        return True, (
            f"{rule}: yes (lowest {low:.2f}× at {tokens}): tcp can go if the fence holds "
            "too (tests/transfer/test_mooncake.py; not measured here)"
        )
    return False, f"{rule}: no ({low:.2f}× at {tokens}): tcp stays beside mooncake"


# -- results -----------------------------------------------------------------------------
@dataclass(frozen=True)
class MethodResult:
    """Timed repeats of one method at one size; ``wait_s`` only for the transports."""

    seconds: tuple[float, ...]
    wait_s: tuple[float, ...] | None
    verified: bool

    @property
    def latency(self) -> Summary:
        return Summary.of(self.seconds)


@dataclass(frozen=True)
class SizeResult:
    """Every method at one request size."""

    tokens: int
    nbytes: int
    blocks: int
    ranges: int  # byte ranges of the whole request (all layers)
    plan_s: float  # block_runs once + every layer's ranges (inside the transports' timings)
    methods: dict[str, MethodResult]

    def gb_per_s(self, method: str) -> float:
        return self.nbytes / self.methods[method].latency.p50 / 1e9

    @property
    def shm_ratio(self) -> float | None:
        return ratio(self.gb_per_s("shm"), self.gb_per_s("memcpy"))

    @property
    def tcp_ratio(self) -> float | None:
        return ratio(self.gb_per_s("tcp"), self.gb_per_s("socket"))

    @property
    def mooncake_ratio(self) -> float | None:
        """mooncake's throughput / tcp's; ``None`` when mooncake did not run."""
        if "mooncake" not in self.methods:
            return None
        return ratio(self.gb_per_s("mooncake"), self.gb_per_s("tcp"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": self.tokens,
            "bytes": self.nbytes,
            "blocks": self.blocks,
            "ranges": self.ranges,
            "plan_s": self.plan_s,
            "methods": {},
            "shm_vs_memcpy": self.shm_ratio,
            "tcp_vs_socket": self.tcp_ratio,
            "mooncake_vs_tcp": self.mooncake_ratio,
            "shm_passed": self.shm_ratio is not None and self.shm_ratio >= SHM_TARGET,
            "tcp_passed": self.tcp_ratio is not None and self.tcp_ratio >= TCP_TARGET,
        }
        for name, res in self.methods.items():
            lat = res.latency
            entry: dict[str, Any] = {
                "gb_per_s": self.gb_per_s(name),
                "p50_s": lat.p50,
                "p99_s": lat.p99,
                "mean_s": lat.mean,
                "verified": res.verified,
                "seconds": list(res.seconds),
            }
            if res.wait_s is not None:
                wait = Summary.of(res.wait_s)
                entry.update(wait_p50_s=wait.p50, wait_p99_s=wait.p99, wait_s=list(res.wait_s))
            out["methods"][name] = entry
        return out


@dataclass(frozen=True)
class HopPath:
    """One serving path: its inter-token gaps and its per-event delivery delays (seconds).

    ``delays``: for every streamed event, the client's receive time minus the decode
    worker's ``produced_unix_ns`` stamp (one host, one clock): what the path adds to each
    token after the worker produced it. Empty for the in-process engine, the baseline, whose
    events are consumed where they are produced. ``error`` when the path could not run.
    """

    name: str
    gaps: tuple[float, ...]
    outputs_match: bool  # same greedy tokens as the in-process engine, every repeat
    error: str | None = None
    delays: tuple[float, ...] = ()
    reference: bool = False  # shown for comparison, not judged against the target

    @property
    def itl(self) -> Summary | None:
        return Summary.of(self.gaps) if self.gaps else None

    @property
    def delay(self) -> Summary | None:
        return Summary.of(self.delays) if self.delays else None


@dataclass(frozen=True)
class HopResult:
    tokens: int
    repeats: int
    paths: tuple[HopPath, ...]
    pinned: bool = False

    def base(self) -> HopPath:
        return self.paths[0]

    def to_json(self) -> dict[str, Any]:
        base = self.base().itl
        paths = []
        for p in self.paths:
            itl = p.itl
            entry: dict[str, Any] = {
                "name": p.name,
                "error": p.error,
                "outputs_match": p.outputs_match,
                "gaps_s": list(p.gaps),
            }
            if itl is not None:
                entry.update(itl_p50_s=itl.p50, itl_p99_s=itl.p99, itl_mean_s=itl.mean, n=itl.n)
                if base is not None and p is not self.base():
                    d50, d99 = added(itl, base)
                    entry.update(
                        added_p50_s=d50, added_p99_s=d99, added_mean_s=itl.mean - base.mean
                    )
            delay = p.delay
            if delay is not None:
                entry.update(
                    delays_s=list(p.delays),
                    delay_p50_s=delay.p50,
                    delay_p99_s=delay.p99,
                    delay_mean_s=delay.mean,
                )
                if not p.reference:
                    entry["passed"] = delay.p99 * 1e3 <= HOP_TARGET_MS
            entry["reference"] = p.reference
            paths.append(entry)
        return {"tokens": self.tokens, "repeats": self.repeats, "pinned": self.pinned,
                "paths": paths}  # fmt: skip


# -- tables ------------------------------------------------------------------------------
def _verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"


def _mooncake_cell(tokens: int, share: float | None) -> str:
    """mooncake ÷ tcp, with the retirement rule's comparison where it is judged."""
    if share is None:
        return "—"
    if tokens < MOONCAKE_FROM_TOKENS:
        return f"{share:.2f}"
    return f"{share:.2f} {'≥' if share >= MOONCAKE_KEEP else '<'} {MOONCAKE_KEEP:.2f}"


def throughput_table(results: Sequence[SizeResult]) -> str:
    """GB/s per method and size (``—`` for a method that did not run) and the ratios judged."""
    header = (
        "tokens", "KV MiB", "ranges", "memcpy bulk", "memcpy", "shm", "shm ÷ memcpy",
        "socket", "tcp", "tcp ÷ socket", "mooncake", "mooncake ÷ tcp",
    )  # fmt: skip
    rows = []
    for r in results:
        shm, tcp = r.shm_ratio, r.tcp_ratio
        rows.append(
            (
                str(r.tokens),
                f"{r.nbytes / 2**20:.1f}",
                str(r.ranges),
                *(f"{r.gb_per_s(m):.2f}" for m in ("memcpy_bulk", "memcpy", "shm")),
                "—" if shm is None else f"{shm:.2f} {_verdict(shm >= SHM_TARGET)}",
                *(f"{r.gb_per_s(m):.2f}" for m in ("socket", "tcp")),
                "—" if tcp is None else f"{tcp:.2f} {_verdict(tcp >= TCP_TARGET)}",
                f"{r.gb_per_s('mooncake'):.2f}" if "mooncake" in r.methods else "—",
                _mooncake_cell(r.tokens, r.mooncake_ratio),
            )
        )
    return markdown_table(header, rows)


def latency_table(results: Sequence[SizeResult]) -> str:
    def ms(summary: Summary) -> str:
        return f"{summary.p50 * 1e3:.2f} / {summary.p99 * 1e3:.2f}"

    def transport(res: MethodResult | None) -> tuple[str, str]:  # latency, finish wait
        if res is None:
            return "—", "—"
        return ms(res.latency), ms(Summary.of(res.wait_s or (0.0,)))

    header = (
        "tokens", "memcpy", "shm", "shm finish wait", "socket", "tcp", "tcp finish wait",
        "mooncake", "mooncake finish wait", "planning",
    )  # fmt: skip
    rows = []
    for r in results:
        m = r.methods
        rows.append(
            (
                str(r.tokens),
                ms(m["memcpy"].latency),
                *transport(m["shm"]),
                ms(m["socket"].latency),
                *transport(m["tcp"]),
                *transport(m.get("mooncake")),
                f"{r.plan_s * 1e3:.2f}",
            )
        )
    return markdown_table(header, rows)


def hop_table(hop: HopResult) -> str:
    """Per path: ITL and its difference to the in-process engine (noisy: it mixes step-time
    jitter in), then the directly measured per-token delivery delay, which is judged."""
    base = hop.base().itl
    header = (
        "path", "gaps", "ITL P50 ms", "ITL P99 ms", "ITL diff P50 ms", "ITL diff P99 ms",
        "events", "added P50 ms", "added P99 ms", "target",
    )  # fmt: skip
    rows = []
    for p in hop.paths:
        itl = p.itl
        if itl is None:
            rows.append((p.name, "0", *("—",) * 7, f"not run: {p.error}"))
            continue
        cells = [p.name, str(itl.n), f"{itl.p50 * 1e3:.2f}", f"{itl.p99 * 1e3:.2f}"]
        if p is hop.base() or base is None:
            cells += ["—", "—"]
        else:
            d50, d99 = added(itl, base)
            cells += [f"{d50 * 1e3:+.2f}", f"{d99 * 1e3:+.2f}"]
        delay = p.delay
        if delay is None:
            cells += ["—", "—", "—", "(baseline)" if p is hop.base() else "no stamps"]
        else:
            verdict = (
                "(reference)"
                if p.reference
                else f"≤ {HOP_TARGET_MS:g} ms {_verdict(delay.p99 * 1e3 <= HOP_TARGET_MS)}"
            )
            cells += [
                str(delay.n), f"{delay.p50 * 1e3:.2f}", f"{delay.p99 * 1e3:.2f}", verdict,
            ]  # fmt: skip
        if not p.outputs_match:
            cells[-1] += " (tokens differ!)"
        rows.append(tuple(cells))
    return markdown_table(header, rows)


# -- peer processes (spawned: nothing inherited by fork) ---------------------------------
def _pattern_fill(buf: torch.Tensor) -> None:
    """Non-constant bytes (period 251, phase-shifted per MiB) without a huge temporary."""
    chunk = 1 << 20
    base = (torch.arange(chunk + 251, dtype=torch.int32) % 251).to(torch.uint8)
    for i, start in enumerate(range(0, buf.numel(), chunk)):
        n = min(chunk, buf.numel() - start)
        shift = i % 251
        buf[start : start + n].copy_(base[shift : shift + n])


def block_sums(pool: torch.Tensor, layout: KVLayout, block_ids: Sequence[int]) -> list[int]:
    """Byte sums of ``block_ids`` in every layer, keys then values (a placement checksum)."""
    view = pool[: layout.total_bytes].view(
        layout.num_layers, 2, layout.num_blocks, layout.block_bytes
    )
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    sums: list[int] = []
    for layer in range(layout.num_layers):
        sums += view[layer][:, ids].sum(dim=-1, dtype=torch.int64).flatten().tolist()
    return sums


def _region_peer(
    conn: Connection, cpus: set[int] | None, transport: str, layout: dict[str, Any]
) -> None:
    """Target main: register a region, send its handle, answer checksum requests."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    lay = KVLayout.from_dict(layout)
    with get_transport(transport, **TRANSPORT_OPTS[transport]) as tp:
        region = tp.register(lay)
        region.tensor.zero_()  # touch every page now, not in the first timed write
        conn.send(region.handle.to_dict())
        while True:
            message = conn.recv()
            if message[0] == "sums":
                conn.send(block_sums(region.tensor, lay, message[1]))
            else:
                region.close()
                conn.send("closed")
                return


_SOCK_HEADER = struct.Struct("<QQ")  # request bytes, 1 = answer with the byte sum


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _socket_peer(conn: Connection, cpus: set[int] | None, capacity: int) -> None:
    """Raw sink main: one connection; per request recv_into a preallocated buffer, ack."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    buf = torch.zeros(capacity, dtype=torch.uint8)  # pages touched before any timing
    view = memoryview(buf.numpy())
    header = bytearray(_SOCK_HEADER.size)
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn.send(server.getsockname()[1])
        sock, _ = server.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            _recv_exactly(sock, memoryview(header))
            nbytes, want_sum = _SOCK_HEADER.unpack(header)
            if nbytes == 0:
                return
            _recv_exactly(sock, view[:nbytes])
            total = int(buf[:nbytes].sum(dtype=torch.int64)) if want_sum else 0
            sock.sendall(struct.pack("<q", total))


class Peer:
    """Parent-side handle on a spawned peer process; ``first`` is its first message."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer process {self.process.pid} did not answer")
        return self.conn.recv()

    def ask(self, message: tuple[Any, ...], timeout: float = 60.0) -> Any:
        self.conn.send(message)
        return self.recv(timeout)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.conn.close()


# -- the transfer measurements -----------------------------------------------------------
def _log(message: str) -> None:
    print(f"[bench.transfer] {message}", file=sys.stderr, flush=True)


class TransferBench:
    """Holds the source pool, the local memcpy destination, the peers and the writers.

    ``skipped``: the methods that cannot run here, with the reason (mooncake without its
    package)."""

    def __init__(self, cfg: BenchConfig, peer_cpus: set[int] | None = None) -> None:
        self.cfg = cfg
        biggest = blocks_for(max(cfg.sizes))
        self.src_layout = kv_layout(biggest + MAX_RUN_BLOCKS)
        self.dst_layout = kv_layout(2 * biggest)
        self.src = torch.empty(self.src_layout.total_bytes, dtype=torch.uint8)
        _pattern_fill(self.src)
        self.source = KVSource(self.src, self.src_layout)
        self.local_dst = torch.zeros(self.dst_layout.total_bytes, dtype=torch.uint8)
        max_bytes = biggest * 2 * NUM_LAYERS * self.src_layout.block_bytes
        self.skipped: dict[str, str] = {}
        self.transports: dict[str, Transport] = {}
        try:  # Mooncake's Transfer Engine is an optional package
            self.transports["mooncake"] = get_transport("mooncake", **TRANSPORT_OPTS["mooncake"])
        except TransferError as e:
            self.skipped["mooncake"] = str(e)
            _log(f"mooncake skipped: {e}")
        regions = [name for name in REGION_METHODS if name not in self.skipped]
        peers = {
            name: Peer(_region_peer, peer_cpus, name, self.dst_layout.to_dict()) for name in regions
        }
        peers["socket"] = Peer(_socket_peer, peer_cpus, max_bytes)
        self.peers = peers
        self.writers = {}
        for name in regions:
            handle = MemoryRegionHandle.from_dict(peers[name].recv(PEER_START_S))
            if name not in self.transports:
                self.transports[name] = get_transport(name, **TRANSPORT_OPTS[name])
            self.writers[name] = self.transports[name].connect(handle, self.source)
        port = peers["socket"].recv(PEER_START_S)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.src_view = memoryview(self.src.numpy())
        self.local_view = memoryview(self.local_dst.numpy())
        self._ids = 0

    def close(self) -> None:
        self.sock.sendall(_SOCK_HEADER.pack(0, 0))
        self.sock.close()
        for tp in self.transports.values():
            tp.close()
        for name in self.writers:
            self.peers[name].ask(("close",))
        for peer in self.peers.values():
            peer.stop()

    # one request, each method ---------------------------------------------------------
    def _memcpy_bulk(self, nbytes: int) -> float:
        src, dst = self.src_view, self.local_view
        t0 = time.perf_counter()
        dst[:nbytes] = src[:nbytes]
        return time.perf_counter() - t0

    def _memcpy(self, ranges: Sequence[ByteRange]) -> float:
        src, dst = self.src_view, self.local_view
        t0 = time.perf_counter()
        for s, d, n in ranges:
            dst[d : d + n] = src[s : s + n]
        return time.perf_counter() - t0

    def _transport(
        self, name: str, src_ids: tuple[int, ...], dst_ids: tuple[int, ...]
    ) -> tuple[float, float]:
        self._ids += 1
        writer = self.writers[name]
        t0 = time.perf_counter()
        job = writer.begin(
            f"bench-{self._ids}", src_ids, dst_ids, deadline=time.monotonic() + DEADLINE_S
        )
        for layer in range(NUM_LAYERS):
            job.write_layer(layer)
        result = job.finish().result(DEADLINE_S)
        elapsed = time.perf_counter() - t0
        return elapsed, result.wait_seconds

    def _socket(
        self, ranges: Sequence[ByteRange], nbytes: int, *, want_sum: bool
    ) -> tuple[float, int]:
        ack = bytearray(8)
        sock, view = self.sock, self.src_view
        t0 = time.perf_counter()
        sock.sendall(_SOCK_HEADER.pack(nbytes, int(want_sum)))
        for s, _, n in ranges:
            sock.sendall(view[s : s + n])
        _recv_exactly(sock, memoryview(ack))
        elapsed = time.perf_counter() - t0
        return elapsed, struct.unpack("<q", ack)[0]

    # one size -------------------------------------------------------------------------
    def size_run(self, tokens: int) -> SizeRun:
        """Set up one request size: its block ids, the ranges a transport job moves, and a
        closure per method. The rounds run on ``SizeRun.run_rounds``."""
        nblocks = blocks_for(tokens)
        src_list, dst_list = request_block_ids(
            nblocks, self.src_layout.num_blocks, self.dst_layout.num_blocks, self.cfg.seed + tokens
        )
        # Tuples, as a prefill worker passes them (its plan's ids and the request's).
        src_ids, dst_ids = tuple(src_list), tuple(dst_list)
        # What a transport job does: find the block runs once, then each layer's ranges.
        t0 = time.perf_counter()
        plan = block_runs(self.src_layout, self.dst_layout, src_ids, dst_ids)
        per_layer = [plan.ranges(layer) for layer in range(NUM_LAYERS)]
        plan_s = time.perf_counter() - t0
        ranges = [r for layer in per_layer for r in layer]
        nbytes = sum(n for _, _, n in ranges)
        # Whole blocks move: the byte count is blocks, not tokens.
        assert nbytes == nblocks * 2 * NUM_LAYERS * self.src_layout.block_bytes
        runs: dict[str, Callable[[], tuple[float, float | None]]] = {
            "memcpy_bulk": lambda: (self._memcpy_bulk(nbytes), None),
            "memcpy": lambda: (self._memcpy(ranges), None),
            "socket": lambda: (self._socket(ranges, nbytes, want_sum=False)[0], None),
        }
        for name in self.writers:
            runs[name] = lambda name=name: self._transport(name, src_ids, dst_ids)
        runs = {m: runs[m] for m in METHODS if m in runs}  # the table's order
        return SizeRun(self, tokens, nblocks, src_ids, dst_ids, ranges, nbytes, plan_s, runs)


class SizeRun:
    """One request size's timed rounds, which may come in several visits (``run_transfer``
    spreads a size's rounds over passes through all the sizes), then its check."""

    def __init__(
        self,
        bench: TransferBench,
        tokens: int,
        nblocks: int,
        src_ids: tuple[int, ...],
        dst_ids: tuple[int, ...],
        ranges: list[ByteRange],
        nbytes: int,
        plan_s: float,
        runs: dict[str, Callable[[], tuple[float, float | None]]],
    ) -> None:
        self.bench, self.tokens, self.nblocks = bench, tokens, nblocks
        self.src_ids, self.dst_ids, self.ranges = src_ids, dst_ids, ranges
        self.nbytes, self.plan_s, self.runs = nbytes, plan_s, runs
        self.seconds: dict[str, list[float]] = {m: [] for m in runs}
        self.waits: dict[str, list[float]] = {m: [] for m in runs}
        # Every method once a round, so drift in machine load hits every method alike; in a
        # fresh order each round, so a disturbance that recurs with a period near a round's
        # length cannot stay on one method's slot for many rounds in a row.
        cfg = bench.cfg
        self._orders = iter(shuffled_rounds(list(runs), cfg.repeats, cfg.seed * 7919 + tokens))

    def run_rounds(self, count: int) -> None:
        """One untimed warm-up call of each method (page faults, first connections, and the
        caches the sizes run since the last visit left cold), then ``count`` timed rounds."""
        for run in self.runs.values():
            run()
        for _ in range(count):
            for name in next(self._orders):
                elapsed, wait = self.runs[name]()
                self.seconds[name].append(elapsed)
                if wait is not None:
                    self.waits[name].append(wait)

    def result(self) -> SizeResult:
        """Check every method's bytes at its destination, then the figures."""
        bench, ranges, nbytes = self.bench, self.ranges, self.nbytes
        src_ids, dst_ids = self.src_ids, self.dst_ids
        # "memcpy" runs once more so the local destination holds its blocks (a round may
        # end with "memcpy_bulk", which overwrites them); the bulk copy is checked after.
        bench._memcpy(ranges)
        want = block_sums(bench.src, bench.src_layout, src_ids)
        socket_sum = bench._socket(ranges, nbytes, want_sum=True)[1]
        verified = {
            "memcpy": block_sums(bench.local_dst, bench.dst_layout, dst_ids) == want,
            "socket": socket_sum == sum(want),
        }
        for name in bench.writers:
            verified[name] = bench.peers[name].ask(("sums", dst_ids)) == want
        bench._memcpy_bulk(nbytes)
        verified["memcpy_bulk"] = bool(bench.local_dst[:nbytes].equal(bench.src[:nbytes]))
        failed = [m for m, ok in verified.items() if not ok]
        if failed:
            raise RuntimeError(f"{self.tokens} tokens: wrong bytes at the destination of {failed}")
        return SizeResult(
            tokens=self.tokens,
            nbytes=nbytes,
            blocks=self.nblocks,
            ranges=len(ranges),
            plan_s=self.plan_s,
            methods={
                m: MethodResult(tuple(self.seconds[m]), tuple(self.waits[m]) or None, verified[m])
                for m in self.runs
            },
        )


def pass_rounds(repeats: int, passes: int) -> list[int]:
    """How many of a size's ``repeats`` rounds each of ``passes`` visits runs: as even as
    whole rounds allow, the larger shares first; they sum to ``repeats``."""
    if passes < 1 or repeats < passes:
        raise ValueError(f"{repeats} rounds cannot fill {passes} passes")
    share, extra = divmod(repeats, passes)
    return [share + (1 if i < extra else 0) for i in range(passes)]


def split_cores(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(first core, second core) to keep two sides apart: with ``pin`` and 2+ cores, the
    first and the second core this process may use; otherwise ``(None, None)``, nothing
    pinned. The transfer part puts this process (the initiator: the source pool, the
    writers' threads, the memcpys) on the first and the targets on the second, as a
    prefill and a decode worker get cores of their own (``pdserve up --pin``); the hop part
    puts this client, the gateway and the control plane on the first and every engine on
    the second (the layout ``pdserve up --pin --control-cpus`` gives)."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None
    return {cores[0]}, {cores[1]}


def run_transfer(cfg: BenchConfig) -> tuple[list[SizeResult], dict[str, str]]:
    """Every size's results, and the methods skipped here with the reason."""
    torch.set_num_threads(1)
    initiator, target = split_cores(cfg.transfer_pin)
    with pinned(initiator):  # the writers' threads start inside: they inherit it
        bench = TransferBench(cfg, peer_cpus=target)
        try:
            runs = [bench.size_run(tokens) for tokens in cfg.sizes]
            # Each size's rounds in ``passes`` visits, the sizes in turn: a disturbance of a
            # second or two (longer than a small size's rounds take) then lands in one
            # visit's share of any size's samples, not in all of them.
            results = []
            shares = pass_rounds(cfg.repeats, cfg.passes)
            for i, count in enumerate(shares):
                for run in runs:
                    run.run_rounds(count)
                    if i == len(shares) - 1:  # checked before another size's writes land
                        res = run.result()
                        rates = ", ".join(f"{m} {res.gb_per_s(m):.2f} GB/s" for m in res.methods)
                        _log(f"{res.tokens} tokens: {rates}")
                        results.append(res)
                _log(f"pass {i + 1}/{len(shares)} done")
            return results, bench.skipped
        finally:
            bench.close()


# -- the hop measurements ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """A service subprocess; ``wait_for`` blocks until a line with ``marker`` is printed.

    It gets its own session so that, if it will not stop on SIGTERM, its whole process
    group (what ``pdserve up`` started) can be killed. The benches drive workers without a
    scheduler, on one host: they run as an insecure cluster (nothing would sign placement
    tokens).
    """

    def __init__(self, argv: Sequence[str], cpus: set[int] | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_CLUSTER_TOKEN")}
        env.update(PYTHONUNBUFFERED="1", PDSERVE_INSECURE_CLUSTER="true")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.address = ""  # where a client connects, once known
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                del self.lines[:-200]
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for(self, marker: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                for line in self.lines:
                    if marker in line:
                        return line
                left = deadline - time.monotonic()
                if self.proc.poll() is not None or left <= 0:
                    tail = "".join(self.lines[-20:])
                    raise RuntimeError(f"{marker!r} never came (exit {self.proc.poll()}):\n{tail}")
                self._seen.wait(min(left, 1.0))

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def gateway_has_cluster_backend() -> bool:
    """Whether ``python -m services.gateway`` offers ``--backend cluster`` here."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "services.gateway", "--help"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "cluster" in out.split("--backend", 1)[-1].split("\n  --", 1)[0]


Arrivals = list[tuple[float, int]]


def _brief(e: BaseException, limit: int = 400) -> str:
    """An error for a table cell: its first line and the end of the rest, on one line."""
    text = " | ".join(line for line in str(e).splitlines() if line.strip())
    return text if len(text) <= limit else f"{text[: limit // 2]} … {text[-limit // 2 :]}"


def _delay_s(produced_unix_ns: int) -> float:
    """Now minus the worker's stamp, in seconds (one host: the same wall clock)."""
    if produced_unix_ns <= 0:
        raise RuntimeError("the event carries no produced_unix_ns stamp")
    return (time.time_ns() - produced_unix_ns) / 1e9


async def _stream_inprocess(aengine: Any, rid: str, ids: list[int], n: int) -> tuple:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    arrivals: Arrivals = []
    tokens: list[int] = []
    async for ev in aengine.generate(rid, ids, params):
        arrivals.append((time.perf_counter(), len(ev.new_token_ids)))
        tokens += ev.new_token_ids
    return arrivals, tokens, []


async def _stream_decode(stub: Any, rid: str, ids: list[int], n: int) -> tuple:
    from pdserve.v1 import common_pb2, worker_pb2

    req = worker_pb2.DecodeGenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )
    arrivals: Arrivals = []
    tokens: list[int] = []
    delays: list[float] = []
    async for ev in stub.Generate(req, timeout=300):
        arrivals.append((time.perf_counter(), len(ev.token_ids)))
        delays.append(_delay_s(ev.produced_unix_ns))
        tokens += ev.token_ids
    return arrivals, tokens, delays


async def _stream_gateway(stub: Any, rid: str, ids: list[int], n: int) -> tuple:
    from pdserve.v1 import common_pb2, gateway_pb2

    req = gateway_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        return_token_ids=True,
    )
    arrivals: Arrivals = []
    tokens: list[int] = []
    delays: list[float] = []
    async for ev in stub.Generate(req, timeout=300):
        arrivals.append((time.perf_counter(), len(ev.token_ids)))
        delays.append(_delay_s(ev.produced_unix_ns))
        tokens += ev.token_ids
    return arrivals, tokens, delays


async def _hop_async(
    cfg: BenchConfig, services: dict[str, Service], errors: dict, engine_cpus: set[int] | None
) -> HopResult:
    import grpc

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.v1 import gateway_pb2_grpc, worker_pb2_grpc
    from services.common.tuning import Tuning

    engine = await asyncio.to_thread(
        LLMEngine,
        EngineConfig(
            weights="float32", kv_cache_dtype="float32", threads=1, kv_cache_mib=HOP_KV_MIB
        ),
    )
    # The in-process engine's thread computes where, and waits as, the workers' engine
    # threads do.
    cpus = None if engine_cpus is None else frozenset(engine_cpus)
    aengine = AsyncEngine(engine, **Tuning(engine_cpus=cpus).engine_options())
    aengine.start()
    streams: dict[str, Callable[[str, list[int], int], Any]] = {
        "in-process AsyncEngine": lambda r, i, n: _stream_inprocess(aengine, r, i, n)
    }
    channels = []
    for key, name in (("decode", DECODE_PATH), ("decode-whole", WHOLE_PIN_PATH)):
        if key not in services:
            continue
        try:
            address = services[key].wait_for("READY ", SERVICE_START_S).split()[2]
            ch = grpc.aio.insecure_channel(address)
            channels.append(ch)
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            streams[name] = lambda r, i, n, stub=stub: _stream_decode(stub, r, i, n)
        except RuntimeError as e:
            errors[name] = f"worker did not come up: {_brief(e)}"
    if "gateway" in services:
        try:
            services["gateway"].wait_for("pdserve is up", SERVICE_START_S)
            ch = grpc.aio.insecure_channel(services["gateway"].address)
            channels.append(ch)
            gstub = gateway_pb2_grpc.GatewayStub(ch)
            streams["gateway → decode gRPC"] = lambda r, i, n: _stream_gateway(gstub, r, i, n)
        except RuntimeError as e:
            errors["gateway → decode gRPC"] = f"stack did not come up: {_brief(e)}"
    try:
        gen = torch.Generator().manual_seed(cfg.seed)
        vocab = engine.model_config.vocab_size
        for i, (name, stream) in enumerate(list(streams.items())):  # warm-up, untimed
            try:
                await stream(f"warm-{i}", torch.randint(0, vocab, (8,)).tolist(), 4)
            except Exception as e:
                if i == 0:
                    raise  # the baseline must run
                errors[name] = f"{type(e).__name__}: {_brief(e)}"  # reported, not fatal
                del streams[name]
        gaps: dict[str, list[float]] = {name: [] for name in streams}
        delays: dict[str, list[float]] = {name: [] for name in streams}
        match: dict[str, bool] = {name: True for name in streams}
        names = list(streams)
        for r in range(cfg.hop_repeats):
            ids = torch.randint(0, vocab, (HOP_PROMPT_TOKENS,), generator=gen).tolist()
            got: dict[str, list[int]] = {}
            # The order rotates each repeat: no path always runs right after another.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                arrivals, tokens, delay = await streams[name](f"hop-{r}", ids, cfg.hop_tokens)
                delays[name] += delay
                if len(tokens) != cfg.hop_tokens:
                    raise RuntimeError(f"{name} streamed {len(tokens)} of {cfg.hop_tokens} tokens")
                got[name] = tokens
                gaps[name] += per_token_gaps(arrivals)
            for name in names:  # greedy: every path must produce the baseline's tokens
                match[name] &= got[name] == got[names[0]]
            _log(
                f"hop repeat {r + 1}/{cfg.hop_repeats}: "
                + ", ".join(
                    f"{n} ITL P50 {percentile(g, 50) * 1e3:.1f} ms" for n, g in gaps.items()
                )
            )
    finally:
        for ch in channels:
            await ch.close()
        await aengine.stop()
    paths = [
        HopPath(name, tuple(g), match[name], delays=tuple(delays[name]),
                reference=name == WHOLE_PIN_PATH)
        for name, g in gaps.items()
    ]  # fmt: skip
    paths += [
        HopPath(name, (), False, err, reference=name == WHOLE_PIN_PATH)
        for name, err in errors.items()
    ]
    return HopResult(cfg.hop_tokens, cfg.hop_repeats, tuple(paths), pinned=bool(engine_cpus))


def run_hop(cfg: BenchConfig) -> HopResult:
    """Start the services (they load while this process loads its engine), measure, stop."""
    services: dict[str, Service] = {}
    errors: dict[str, str] = {}
    client, engine = split_cores(cfg.hop_pin)
    try:
        worker = ["-m", "services.decode", "--role", "colocated", "--port", "0", "--threads",
                  "1", "--kv-cache-mib", str(HOP_KV_MIB), "--metrics-port", "0"]  # fmt: skip
        # Laid out by `pdserve up --pin --control-cpus`'s own rule: the engine thread alone on
        # the engine core, the process also on the client's (a control core no engine uses).
        plan = {"decode": min(engine)} if engine else {}
        cpus, pin = worker_placement("decode", plan, client)
        services["decode"] = Service([*worker, *pin], cpus=cpus)
        if cfg.hop_whole_pin:
            if engine:  # the layout before --engine-cpus: every thread on the engine core
                cpus, pin = worker_placement("decode", plan, None)
                services["decode-whole"] = Service([*worker, *pin], cpus=cpus)
            else:
                errors[WHOLE_PIN_PATH] = "skipped (nothing is pinned: --no-hop-pin or 1 core)"
        if not cfg.gateway:
            errors["gateway → decode gRPC"] = "skipped (--no-gateway)"
        elif not gateway_has_cluster_backend():
            errors["gateway → decode gRPC"] = "services.gateway has no --backend cluster"
        else:
            grpc_port = _free_port()
            pin = ["--pin", "--control-cpus", str(min(client))] if client else ["--no-pin"]
            gw = Service(
                ["-m", "services.cli", "up", "--colocated", "--http-port", str(_free_port()),
                 "--grpc-port", str(grpc_port), "--threads", "1",
                 "--kv-cache-mib", str(HOP_KV_MIB), *pin], cpus=client,
            )  # fmt: skip
            gw.address = f"127.0.0.1:{grpc_port}"
            services["gateway"] = gw
        with pinned(client):  # this thread: the client's event loop
            return asyncio.run(_hop_async(cfg, services, errors, engine))
    finally:
        for svc in services.values():
            svc.stop()


# -- the command line --------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.transfer",
        description="KV transfer (shm, tcp, mooncake) beside memcpy and a raw socket, and the "
        "per-token latency of the serving hop over the in-process engine.",
    )
    p.add_argument(
        "--sizes", type=int, nargs="+", help="request sizes in tokens (default: 128 … 4096)"
    )
    p.add_argument("--repeats", type=int, help="timed transfers per method and size (default: 100)")
    p.add_argument(
        "--passes",
        type=int,
        help="visits per size: each runs its share of the rounds, the sizes taking turns "
        "(default: 5; 1 with --quick)",
    )
    p.add_argument("--skip-hop", action="store_true", help="skip the serving-hop latency part")
    p.add_argument("--hop", action="store_true", help="run the hop even with --quick")
    p.add_argument("--hop-tokens", type=int, help="tokens per hop request (default: 64)")
    p.add_argument("--hop-repeats", type=int, help="requests per hop path (default: 10)")
    p.add_argument("--no-gateway", action="store_true", help="hop: skip the pdserve-up stack")
    p.add_argument(
        "--hop-whole-pin",
        action="store_true",
        help="hop: also stream from a decode worker whose every thread is pinned to the "
        "engine core (no --engine-cpus), a reference row beside the default layout",
    )
    p.add_argument(
        "--no-hop-pin",
        action="store_true",
        help="hop: leave every process unpinned (default with 2+ cores: each engine on the "
        "second core, this client, the gateway and the control plane on the first)",
    )
    p.add_argument(
        "--no-transfer-pin",
        action="store_true",
        help="transfer: leave every process unpinned (default with 2+ cores: this process on "
        "the first core, the shm, tcp, mooncake and socket targets on the second)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of block ids and prompts")
    p.add_argument("--json", metavar="OUT", help="write results (every sample) to this file")
    p.add_argument(
        "--quick", action="store_true", help="128 and 256 tokens, 5 repeats, no hop (a smoke test)"
    )
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Flags given explicitly win; the rest come from --quick's or the full run's defaults."""
    base = _QUICK if args.quick else _DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return base[name] if value is None else value

    hop = (base["hop"] or args.hop) and not args.skip_hop
    return BenchConfig(
        sizes=tuple(pick("sizes")),
        repeats=pick("repeats"),
        passes=min(pick("passes"), pick("repeats")) if args.passes is None else args.passes,
        hop=hop,
        hop_tokens=pick("hop_tokens"),
        hop_repeats=pick("hop_repeats"),
        gateway=not args.no_gateway,
        seed=args.seed,
        hop_pin=not args.no_hop_pin,
        transfer_pin=not args.no_transfer_pin,
        hop_whole_pin=args.hop_whole_pin,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:  # a value no flag's type can check alone (passes > repeats)
        parser.error(str(e))
    command = shlex.join(["python", "-m", "bench.transfer", *argv])
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = load_average()
    t0 = time.perf_counter()
    sizes, skipped = run_transfer(cfg)
    retire, verdict = tcp_retirement(
        [(r.tokens, r.mooncake_ratio) for r in sizes], skipped.get("mooncake")
    )
    load_mid = load_average()
    hop = run_hop(cfg) if cfg.hop else None
    load_after = load_average()
    machine = machine_info()
    print(f"command: {command}")
    print(
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs; started {started}; "
        f"load {load_before[0]:.2f} -> {load_mid[0]:.2f} -> {load_after[0]:.2f}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print()
    initiator, target = split_cores(cfg.transfer_pin)
    placement = (
        f"this process on core {min(initiator)}, the targets on core {min(target)}"
        if initiator and target
        else "unpinned"
    )
    print(f"Throughput, GB/s at the median latency ({cfg.repeats} repeats in {cfg.passes} "
          f"passes, {placement}, "
          f"the host's congestion control on every connection (mooncake's protocol tcp); "
          f"targets: shm ≥ {SHM_TARGET:.2f}× memcpy, tcp ≥ {TCP_TARGET:.2f}× socket):")  # fmt: skip
    print(throughput_table(sizes))
    print(f"Retiring tcp (issue 35): {verdict}")
    print()
    print("Per-request latency, ms P50 / P99:")
    print(latency_table(sizes))
    if hop is not None:
        print()
        print(
            f"Serving hop: inter-token latency, {hop.repeats} requests × {hop.tokens} tokens "
            f"per path, 1 thread per engine"
            + (
                ", engines pinned to one core, client, gateway and control plane to another:"
                if hop.pinned
                else " (unpinned):"
            )
        )
        print(hop_table(hop))
    if args.json:
        write_json(
            args.json,
            {
                "command": command,
                "started": started,
                "wall_s": time.perf_counter() - t0,
                "config": asdict(cfg),
                "machine": machine,
                "load": {"before": load_before, "after_transfer": load_mid, "after": load_after},
                "layout": {**kv_layout(1).to_dict(), "bytes_per_token": BYTES_PER_TOKEN},
                "targets": {
                    "shm_vs_memcpy": SHM_TARGET,
                    "tcp_vs_socket": TCP_TARGET,
                    "hop_added_p99_ms": HOP_TARGET_MS,
                    "mooncake_vs_tcp": MOONCAKE_KEEP,
                    "mooncake_from_tokens": MOONCAKE_FROM_TOKENS,
                },
                "skipped": skipped,
                "tcp_retirement": {"retire": retire, "verdict": verdict},
                "transfer": [r.to_json() for r in sizes],
                "hop": None if hop is None else hop.to_json(),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One chaos run, start to stop.

Lifecycle: /dev/shm measured -> stack started (``pdserve up``'s ``launch``, fault spec in the
prefill workers' environment) -> free KV blocks and migration counters read -> requests sent
(at most ``concurrency`` at once, each with its own deadline) while ``pdserve up``'s
supervisor ticks and the planned ``kill -9``s fire -> wait (at most ``lease_wait_s``) for the
survivors' free blocks to come back -> counters and the gateway log read -> stack stopped and
dead workers' segments swept, as ``pdserve up`` does -> /dev/shm measured -> the greedy
reference computed in this process (the CPUs are free by then) -> ``ChaosReport``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.chaos import probes, reference
from bench.chaos.client import Outcome, chat
from bench.chaos.disruptions import Kill, plan
from bench.chaos.prompts import context, question
from bench.chaos.report import ChaosReport, count_outcomes, mismatches
from services.launcher import Stack, free_port
from services.up import launch, load_up_config, supervise


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run. ``prefill_deadline_s``: the decode workers' prefill deadline, whose
    KV lease (it plus 2 s) holds a killed prefill worker's destination blocks.
    ``context_words``: a shared preamble before every question (0: none), so requests share
    KV blocks the KV store (``kv_store_segment_mib`` per worker, 0: none) serves.
    ``lease_wait_s``: how long to wait after the last request for the surviving workers'
    free KV blocks to return (default: the lease plus 3 s)."""

    requests: int = 300
    concurrency: int = 16
    max_tokens: int = 24
    deadline_s: float = 120.0
    fault_rate: float = 0.0
    fault_seed: int = 1
    kill_prefill: bool = False
    kill_decode: bool = False
    restart_redis: bool = False
    restart_kv_store: bool = False
    context_words: int = 0
    kv_store_segment_mib: int = 256
    prefill: int = 2
    decode: int = 2
    kv_cache_mib: int = 64
    prefill_deadline_s: float = 30.0
    lease_wait_s: float | None = None
    log_dir: str | None = None
    transport: str = "shm,tcp"  # the decode workers' KV transports, round-robin

    @property
    def lease_wait(self) -> float:
        return self.prefill_deadline_s + 5.0 if self.lease_wait_s is None else self.lease_wait_s

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("requests, concurrency and max_tokens must be >= 1")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate={self.fault_rate} must be in [0, 1]")
        if (self.kill_prefill and self.prefill < 2) or (self.kill_decode and self.decode < 2):
            raise ValueError("killing a worker needs another one of its role to serve on")
        if self.context_words < 0 or self.kv_store_segment_mib < 0:
            raise ValueError("context_words and kv_store_segment_mib must be >= 0")
        if self.restart_kv_store and not self.kv_store_segment_mib:
            raise ValueError("restarting the KV store needs one (kv_store_segment_mib > 0)")


def _say(line: str) -> None:
    print(f"chaos: {line}", file=sys.stderr, flush=True)


def run(cfg: ChaosConfig, say: Callable[[str], None] = _say) -> ChaosReport:
    """Run ``cfg`` against a stack started here, and stop it again."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    started = time.monotonic()
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shm_before = probes.kv_segments()
    env = {"PDSERVE_DECODE_PREFILL_DEADLINE_S": str(cfg.prefill_deadline_s)}
    if cfg.fault_rate > 0:
        env["PDSERVE_FAULTS"] = f"fail_rate={cfg.fault_rate},seed={cfg.fault_seed}"
    up = load_up_config(_up_argv(cfg, log_dir), {})
    stack = Stack(log_dir=log_dir, env=env)
    say(f"starting the stack (logs: {log_dir})")
    phases: dict[str, float] = {}
    try:
        endpoints = launch(up, stack)
        phases["start_s"] = time.monotonic() - started
        say(f"the stack is up after {phases['start_s']:.1f} s; sending requests")
        live = asyncio.run(_drive(cfg, stack, endpoints, say))
        phases.update(requests_s=live.requests_s, kv_wait_s=live.free_wait_s)
    finally:
        stopping = time.monotonic()
        stack.stop()
        from transfer.shm import sweep_stale_segments  # here: it imports torch

        swept = sweep_stale_segments()
        phases["stop_s"] = time.monotonic() - stopping
    shm_after = probes.kv_segments()
    say("the stack stopped; computing the greedy reference")
    computing = time.monotonic()
    ref = reference.greedy_texts([o.question for o in live.outcomes], cfg.max_tokens)
    phases["reference_s"] = time.monotonic() - computing
    return _report(
        cfg,
        live,
        ref,
        log_dir=log_dir,
        date=date,
        wall_s=time.monotonic() - started,
        phases=phases,
        shm=(shm_before, shm_after, swept),
    )


def _up_argv(cfg: ChaosConfig, log_dir: Path) -> list[str]:
    """``pdserve up``'s flags for ``cfg``'s stack, on free ports."""
    return [
        "--prefill", str(cfg.prefill), "--decode", str(cfg.decode),
        "--transport", cfg.transport, "--kv-cache-mib", str(cfg.kv_cache_mib),
        "--kv-store-segment-mib", str(cfg.kv_store_segment_mib),
        "--http-port", str(free_port()), "--grpc-port", str(free_port()),
        "--log-dir", str(log_dir),
    ]  # fmt: skip


def _report(
    cfg: ChaosConfig,
    live: _Live,
    ref: dict[str, str],
    *,
    log_dir: Path,
    date: str,
    wall_s: float,
    phases: dict[str, float],
    shm: tuple[dict[str, int], dict[str, int], list[str]],
) -> ChaosReport:
    """The run's figures: outcomes, migrations, answers against ``ref``, KV and /dev/shm."""
    shm_before, shm_after, swept = shm
    completed, failed, hung, causes = count_outcomes(live.outcomes)
    migrated = probes.migrated_requests(log_dir / "gateway.log")
    return ChaosReport(
        config={**asdict(cfg), "log_dir": str(log_dir)},
        date=date,
        wall_s=wall_s,
        phases_s=phases,
        requests=cfg.requests,
        completed=completed,
        failed=failed,
        hung=hung,
        error_causes=causes,
        hung_requests=[
            {"index": o.index, "request_id": o.request_id, "question": o.question}
            for o in live.outcomes
            if o.hung
        ],
        migrations_by_cause={
            c: live.migrations_after.get(c, 0.0) - live.migrations_before.get(c, 0.0)
            for c in live.migrations_after
        },
        migrated_requests=migrated,
        migrated_completed=sum(o.completed and o.request_id in migrated for o in live.outcomes),
        mismatches=mismatches(live.outcomes, ref, migrated),
        free_blocks_before=live.free_before,
        free_blocks_after=live.free_after,
        free_blocks_wait_s=live.free_wait_s,
        disrupted={
            k.target: f"killed after {k.after} finished, restarted"
            for k in live.fired
            if k.target not in ("redis", "kv-store")
        },
        kv_store=live.kv_store,
        shm_bytes_before=sum(shm_before.values()),
        shm_bytes_after=sum(shm_after.values()),
        shm_left={n: b for n, b in shm_after.items() if n not in shm_before},
        shm_swept=swept,
        kills=live.kills,
        supervisor=live.said,
        supervisor_stopped=live.stopped,
        outcomes=[{**asdict(o), "migrated": migrated.get(o.request_id, [])} for o in live.outcomes],
    )


@dataclass(frozen=True)
class _Live:
    """What ``_drive`` measured while the stack ran."""

    outcomes: list[Outcome]
    free_before: dict[str, int | None]
    free_after: dict[str, int | None]
    free_wait_s: float
    requests_s: float
    migrations_before: dict[str, float]
    migrations_after: dict[str, float]
    kv_store: dict[str, float]
    fired: list[Kill]
    kills: list[dict[str, object]]
    said: list[str]
    stopped: str | None


async def _drive(
    cfg: ChaosConfig, stack: Stack, endpoints: dict[str, str], say: Callable[[str], None]
) -> _Live:
    t0 = time.monotonic()
    said: list[str] = []
    stopped: list[str] = []

    def note(line: str) -> None:
        said.append(f"t={time.monotonic() - t0:.1f} s: {line}")
        say(line)

    supervisor = supervise(stack, note)

    async def tick() -> None:
        while (reason := supervisor.tick()) is None:
            await asyncio.sleep(0.2)
        stopped.append(reason)
        note(f"the supervisor gives up: {reason}")

    ticker = asyncio.create_task(tick())
    gateway_metrics = endpoints["http"].removesuffix("/v1") + "/metrics"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=cfg.concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{endpoints['http']}/models") as r:
            model = (await r.json())["data"][0]["id"]
        free_before = await _reported_free_blocks(session, endpoints)
        migrations_before = await probes.migrations(session, gateway_metrics)
        killer = _Killer(stack, _kills(cfg), t0, note)
        gate = asyncio.Semaphore(cfg.concurrency)

        async def one(i: int) -> Outcome:
            async with gate:
                out = await chat(
                    session,
                    endpoints["http"],
                    model,
                    context(cfg.context_words) + question(i),
                    index=i,
                    max_tokens=cfg.max_tokens,
                    deadline_s=cfg.deadline_s,
                )
            finished = killer.one_finished()
            if finished % max(1, cfg.requests // 10) == 0:
                say(f"{finished}/{cfg.requests} finished")
            return out

        outcomes = list(await asyncio.gather(*(one(i) for i in range(cfg.requests))))
        requests_s = time.monotonic() - t0
        say("every request finished; waiting for the KV blocks to come back")
        waited = time.monotonic()
        free_after = await _blocks_back(
            session, endpoints, stack, free_before, killer.fired, deadline=waited + cfg.lease_wait
        )
        free_wait_s = time.monotonic() - waited
        migrations_after = await probes.migrations(session, gateway_metrics)
        kv_store = await probes.kv_store_counters(session, endpoints)
    ticker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ticker
    return _Live(
        outcomes=outcomes,
        free_before=free_before,
        free_after=free_after,
        free_wait_s=free_wait_s,
        requests_s=requests_s,
        migrations_before=migrations_before,
        migrations_after=migrations_after,
        kv_store=kv_store,
        fired=killer.fired,
        kills=killer.kills,
        said=said,
        stopped=stopped[0] if stopped else None,
    )


@dataclass
class _Killer:
    """Fires the planned ``kill -9``s as requests finish, and records each."""

    stack: Stack
    pending: list[Kill]
    t0: float
    note: Callable[[str], None]
    finished: int = 0
    fired: list[Kill] = field(default_factory=list)
    kills: list[dict[str, object]] = field(default_factory=list)

    def one_finished(self) -> int:
        """Count a finished request, kill every target planned for at most that many, and
        return the count."""
        self.finished += 1
        finished = self.finished
        while self.pending and finished >= self.pending[0].after:
            kill = self.pending.pop(0)
            proc = self.stack.named(kill.target)
            assert proc.popen is not None
            proc.popen.kill()
            self.fired.append(kill)
            self.kills.append(
                {
                    "target": kill.target,
                    "pid": proc.popen.pid,
                    "after": finished,
                    "t_s": time.monotonic() - self.t0,
                }
            )
            self.note(f"kill -9 {kill.target} (pid {proc.popen.pid}) after {finished} finished")
        return finished


def _kills(cfg: ChaosConfig) -> list[Kill]:
    return list(
        plan(
            cfg.requests,
            kill_prefill=cfg.kill_prefill,
            kill_decode=cfg.kill_decode,
            restart_redis=cfg.restart_redis,
            restart_kv_store=cfg.restart_kv_store,
        )
    )


async def _reported_free_blocks(
    session: aiohttp.ClientSession, endpoints: dict[str, str]
) -> dict[str, int | None]:
    """Free KV blocks per worker, waiting (up to 10 s) for every worker to report: the gauge
    is set with each heartbeat, and the first may be due."""
    free = await probes.free_blocks(session, endpoints)
    for _ in range(20):
        if None not in free.values():
            break
        await asyncio.sleep(0.5)
        free = await probes.free_blocks(session, endpoints)
    return free


async def _blocks_back(
    session: aiohttp.ClientSession,
    endpoints: dict[str, str],
    stack: Stack,
    free_before: dict[str, int | None],
    fired: list[Kill],
    *,
    deadline: float,
) -> dict[str, int | None]:
    """Free KV blocks per worker once the workers not killed have all of theirs back and the
    restarted ones are ready, or at ``deadline`` (``time.monotonic()``), whichever is first."""
    survivors = [w for w in free_before if w not in {k.target for k in fired}]
    while True:
        free_after = await probes.free_blocks(session, endpoints)
        back = all(free_after.get(w) == free_before[w] for w in survivors)
        restarted_ready = all(stack.named(k.target).ready.is_set() for k in fired)
        if (back and restarted_ready) or time.monotonic() > deadline:
            return free_after
        await asyncio.sleep(0.5)

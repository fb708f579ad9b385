"""End to end with hosts apart: every service in its own network namespace, joined by a
bridge (``tests.netns``), so KV and control traffic cross real interfaces and a host can
be cut off by taking its link down while its processes run on.

Hosts: ``ctl`` (redis-server, scheduler), ``prefill``, ``decode-a`` and ``decode-b`` (KV
over tcp, then the whole module again over mooncake: Mooncake's Transfer Engine, protocol
tcp), ``gw`` (gateway) and ``client``, where a small subprocess (``ns_client``) sends
the OpenAI requests and scrapes ``/metrics``: this test's own process, in the root
namespace, reaches none of them. Skipped only where namespaces cannot be made (not root,
or the machine forbids them).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from kernels.layer_ops import layer_ops_available
from kernels.paged_attention import cpu_kernel_available
from kernels.quant_linear import kernel_available
from services.launcher import REDIS_USER, Proc, Stack, redis_password_file, redis_proc
from tests.netns import Host, NamespacesUnavailable, Network
from tests.scrape import metric_in

ROOT = Path(__file__).resolve().parents[2]
# A private subnet no real network here uses; it exists only inside this run's namespaces.
SUBNET = "10.213.7.0/24"
MODEL = "smollm2"
SCHEDULER_PORT, REDIS_PORT, HTTP_PORT = 50050, 6379, 8000  # each host has its own ports
WORKER_PORT, KV_PORT, METRICS_PORT = 50060, 50070, 9090
LEASE_S = 1.5  # the scheduler's heartbeat lease: short, so a cut host lapses soon
# SmolLM2-135M's KV per token: 30 layers x 3 KV heads x 64 dims x float16 (the workers'
# default on the CPU), K and V.
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2
BLOCK = 16
QUESTION = "What is the capital of France?"
SHORT = 16
POEM = "Write a long poem about the number 7."
LONG = 48  # tokens: the stream is still running when its decode host is cut after 3
DECODES = ("decode-a", "decode-b")


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


@dataclass
class Cluster:
    net: Network
    stack: Stack
    transport: str  # how the prefill worker writes into the decode workers' pools

    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    def client(self, *args: str, timeout_s: float = 10.0) -> list[str]:
        """``ns_client`` run in the client namespace."""
        argv = [sys.executable, "-m", "tests.e2e.ns_client", *args, "--timeout", str(timeout_s)]
        return self.host("client").argv(argv)

    def metrics(self, host: str, port: int = METRICS_PORT) -> str:
        url = f"http://{self.host(host).address}:{port}/metrics"
        done = subprocess.run(
            self.client("get", url), capture_output=True, text=True, timeout=20, check=False
        )
        assert done.returncode == 0, f"{url}: {done.stderr[-1000:]}"
        return done.stdout

    def metric(self, host: str, name: str, labels: str = "", port: int = METRICS_PORT) -> float:
        return metric_in(self.metrics(host, port), name, labels, host)

    def scheduler_metric(self, name: str, labels: str = "") -> float:
        return self.metric("ctl", name, labels, port=9091)

    def gateway_metric(self, name: str, labels: str = "") -> float:
        return self.metric("gw", name, labels, port=HTTP_PORT)

    def scheduler_log(self, event: str, worker_id: str) -> list[dict[str, Any]]:
        """The scheduler's JSON log records of ``event`` about ``worker_id``."""
        found = []
        for line in (self.stack.log_dir / "scheduler.log").read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the READY line
            if rec.get("event") == event and rec.get("worker_id") == worker_id:
                found.append(rec)
        return found

    def chat(self, question: str, max_tokens: int, timeout_s: float = 60.0) -> Stream:
        body = json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        })  # fmt: skip
        url = f"http://{self.host('gw').address}:{HTTP_PORT}/v1/chat/completions"
        return Stream(self.client("stream", url, body, timeout_s=timeout_s))


class Stream:
    """An ``ns_client stream`` subprocess; its JSON lines as they come."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, timeout_s: float) -> dict[str, Any] | None:
        """The next line (None: the client exited), failing after ``timeout_s``."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout_s} s; so far {self.seen}") from None
        if line is not None:
            self.seen.append(line)
        return line

    def content_chunks(self) -> int:
        return sum(1 for ln in self.seen if _delta(ln))

    def finish(self, timeout_s: float) -> Reply:
        """Read to the end (``timeout_s`` in all) and reap the client."""
        deadline = time.monotonic() + timeout_s
        while (line := self.next(max(0.0, deadline - time.monotonic()))) is not None:
            if "done" in line or "exception" in line or "http_error" in line:
                break
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
        return Reply.of(self.seen)


def _delta(line: dict[str, Any]) -> str:
    choices = line.get("data", {}).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str | None
    usage: dict[str, Any]
    served_by: dict[str, Any]  # the gateway's "pdserve" extension: workers and KV bytes
    ended: dict[str, Any]  # the last line: {"done": true} or what went wrong

    @classmethod
    def of(cls, lines: list[dict[str, Any]]) -> Reply:
        reason, usage, served = None, {}, {}
        for ln in lines:
            data = ln.get("data", {})
            for choice in data.get("choices") or []:
                reason = choice.get("finish_reason") or reason
            usage = data.get("usage") or usage
            served = data.get("pdserve") or served
        text = "".join(_delta(ln) for ln in lines)
        return cls(text, reason, usage, served, lines[-1] if lines else {})


@pytest.fixture(scope="module", params=["tcp", "mooncake"])
def cluster(request, tmp_path_factory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    prefix = f"pdt-{os.getpid()}-"
    try:
        net = Network.create(prefix, SUBNET)
    except NamespacesUnavailable as e:
        pytest.skip(f"this machine does not allow network namespaces: {e}")
    drain = {f"PDSERVE_{s}_DRAIN_TIMEOUT_S": "0.5"
             for s in ("SCHEDULER", "PREFILL", "DECODE", "GATEWAY")}  # fmt: skip
    stack = Stack(
        log_dir=tmp_path_factory.mktemp("hosts-apart"),
        env={"PYTHONPATH": str(ROOT), "PDSERVE_CLUSTER_TOKEN": secrets.token_urlsafe(32),
             "PDSERVE_CLUSTER_TOKEN_FILE": "", **drain},
    )  # fmt: skip
    try:
        for name in ("ctl", "prefill", *DECODES, "gw", "client"):
            net.add_host(name)
        _start(Cluster(net, stack, request.param))
        yield Cluster(net, stack, request.param)
    finally:
        try:
            stack.stop()
        finally:
            left = net.destroy()
        assert not left, f"namespaces left behind: {left}"


def _start(c: Cluster) -> None:
    # Built here, once, not by three workers at a time: a worker killed while it builds
    # (a failed start's teardown) leaves torch's build lock behind for every later one.
    # (Where they cannot be built, workers run the torch path: nothing to assert.)
    cpu_kernel_available(), layer_ops_available(), kernel_available()
    ctl = c.host("ctl")
    redis = redis_proc(REDIS_PORT, c.stack.log_dir)
    redis.argv = ctl.argv(redis.argv)
    c.stack.start(redis, ready_line="Ready to accept connections")
    scheduler = f"{ctl.address}:{SCHEDULER_PORT}"
    c.stack.start(Proc("scheduler", ctl.argv(_py(
        "services.scheduler", "--grpc-host", "0.0.0.0", "--grpc-port", str(SCHEDULER_PORT),
        "--metrics-port", "9091", "--redis-url", f"redis://127.0.0.1:{REDIS_PORT}/0",
        "--redis-username", REDIS_USER,
        "--redis-password-file", str(redis_password_file(c.stack.log_dir)),
        "--heartbeat-ttl-s", str(LEASE_S), "--local-prefill-max-tokens", "0",
        # round-robin: a new request after a migration goes to the other decode worker
        "--routing", "round-robin",
    ))))  # fmt: skip
    c.stack.wait_ready(c.stack.procs, timeout=60)
    # Small engines: one thread each (two cores for six processes), a small KV pool.
    engine = ["--threads", "1", "--kv-cache-mib", "32", "--max-model-len", "1024"]

    def worker(name: str, module: str, *flags: str) -> Proc:
        host = c.host(name)
        argv = _py(module, "--host", "0.0.0.0", "--advertise-host", host.address,
                   "--port", str(WORKER_PORT), "--metrics-port", str(METRICS_PORT),
                   "--worker-id", name, "--scheduler", scheduler, *engine, *flags)  # fmt: skip
        return c.stack.start(Proc(name, host.argv(argv)))

    if c.transport == "tcp":
        pre, dec = [], ["--kv-port", str(KV_PORT)]
    else:  # the machines here have no RDMA device: say so rather than rely on auto
        pre = dec = ["--mooncake-protocol", "tcp"]
    started = [worker("prefill", "services.prefill", "--transports", c.transport, *pre)]
    started += [worker(d, "services.decode", "--transport", c.transport, *dec) for d in DECODES]
    started.append(c.stack.start(Proc("gateway", c.host("gw").argv(_py(
        "services.gateway", "--host", "0.0.0.0", "--http-port", str(HTTP_PORT),
        "--grpc-port", "50051", "--backend", "cluster", "--scheduler", scheduler,
        "--served-model-name", MODEL, "--max-model-len", "1024",
        # a decode host cut off is noticed by pings within about twice this
        "--worker-keepalive-s", "0.5",
    )))))  # fmt: skip
    c.stack.wait_ready(started, timeout=120)
    wait_until(
        lambda: (
            c.scheduler_metric("pdserve_scheduler_workers", 'role="decode"') == 2
            and c.scheduler_metric("pdserve_scheduler_workers", 'role="prefill"') == 1
        ),
        30,
        "every worker registered with the scheduler",
    )


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


@pytest.fixture(scope="module")
def expected(make_engine, default_tokenizer) -> dict[str, str]:
    """The greedy answers of one in-process engine: what the cluster must stream."""
    tok = default_tokenizer
    asks = {QUESTION: SHORT, POEM: LONG}
    engine = make_engine()
    out = {}
    for q, n in asks.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
        out[q] = engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0))[0].text
    return out


def test_kv_crosses_the_prefill_hosts_link(cluster: Cluster, expected) -> None:
    """A request's KV leaves the prefill host through its interface: the interface sent at
    least the KV the worker reports writing, and the answer is the greedy one."""
    before = {name: cluster.host(name).counters() for name in ("prefill", *DECODES)}
    label = f'transport="{cluster.transport}"'
    sent = cluster.metric("prefill", "pdserve:kv_transfer_bytes_total", label)
    reply = cluster.chat(QUESTION, SHORT).finish(60)
    assert reply.ended.get("done"), reply.ended
    assert reply.text == expected[QUESTION]
    kv = reply.served_by["kv_transfer_bytes"]
    # the module's first request: nothing cached anywhere, every prompt block crosses
    blocks = -(-reply.usage["prompt_tokens"] // BLOCK)
    assert kv == blocks * BLOCK * KV_BYTES_PER_TOKEN
    assert reply.served_by["prefill_worker_id"] == "prefill"
    assert cluster.metric("prefill", "pdserve:kv_transfer_bytes_total", label) == sent + kv
    after = {name: cluster.host(name).counters() for name in ("prefill", *DECODES)}
    assert after["prefill"]["tx"] - before["prefill"]["tx"] >= kv, (before, after, kv)
    receiver = reply.served_by["decode_worker_id"]
    assert after[receiver]["rx"] - before[receiver]["rx"] >= kv, (before, after, kv)


def test_a_cut_decode_host_lapses_its_stream_migrates_and_it_returns(
    cluster: Cluster, expected
) -> None:
    """Mid-stream, the decode host's link goes down: the scheduler's lease on it lapses,
    the gateway moves the stream to the other decode worker, which resumes after the tokens
    the client has (the same greedy text, one stream). Link up: the worker registers
    again and is placed a request."""
    received = "pdserve:kv_transfer_bytes_total"  # KV a decode worker was sent
    first = {d: cluster.metric(d, received) for d in DECODES}
    expired = cluster.scheduler_metric("pdserve_scheduler_expired_workers_total")
    moved = cluster.gateway_metric("pdserve:migrations_total", 'cause="decode_lost"')
    stream = cluster.chat(POEM, LONG)
    while stream.content_chunks() < 3:
        line = stream.next(60)
        assert line is not None and "data" in line, stream.seen
    # the decode worker that took the prompt's KV (and streams now)
    (victim,) = [d for d in DECODES if cluster.metric(d, received) > first[d]]
    (survivor,) = [d for d in DECODES if d != victim]
    registered = len(cluster.scheduler_log("worker_registered", victim))
    host = cluster.host(victim)
    cut = time.monotonic()
    host.set_link(False)
    try:
        reply = stream.finish(60)
        took = time.monotonic() - cut
        assert reply.ended.get("done"), reply.ended
        assert reply.text == expected[POEM]
        assert reply.served_by["decode_worker_id"] == survivor
        assert cluster.gateway_metric("pdserve:migrations_total", 'cause="decode_lost"') == (
            moved + 1
        )
        wait_until(lambda: cluster.scheduler_log("worker_removed", victim), 10, "lease lapse")
        (removed,) = cluster.scheduler_log("worker_removed", victim)
        assert removed["reason"] == "lease lapsed"
        assert cluster.scheduler_metric("pdserve_scheduler_expired_workers_total") == expired + 1
        assert cluster.scheduler_metric("pdserve_scheduler_workers", 'role="decode"') == 1
    finally:
        host.set_link(True)
    back = time.monotonic()
    wait_until(
        lambda: len(cluster.scheduler_log("worker_registered", victim)) > registered,
        30,
        f"{victim} registered again",
    )
    again = time.monotonic() - back
    assert cluster.scheduler_metric("pdserve_scheduler_workers", 'role="decode"') == 2
    served = cluster.metric(victim, "pdserve:request_success_total")
    reply = cluster.chat(QUESTION, SHORT).finish(60)
    assert reply.text == expected[QUESTION]
    assert reply.served_by["decode_worker_id"] == victim
    assert cluster.metric(victim, "pdserve:request_success_total") == served + 1
    print(f"link cut: stream finished {took:.1f} s later; registered again {again:.1f} s "
          f"after the link came back")  # fmt: skip

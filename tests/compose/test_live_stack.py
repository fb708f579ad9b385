"""The compose stack run for real in Docker: build, up, serve, scale, crash, down.

Marked ``compose``: ``bash compose/test.sh`` installs and starts a Docker engine, then runs
these with ``pytest -m compose``; the default run leaves them out (they need the engine and
about ten minutes). The tests share one stack and run in file order: 2 prefill + 2 decode
serve the OpenAI SDK, the ``monitoring`` profile's Prometheus scrapes every service, decode
scales to 3 and the new replica takes requests, one decode container crashes mid-stream and
the stream completes while Docker restarts it. The fixture ends with ``down -v`` and fails
if any container, network or volume of the project is left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.redis_server import free_port
from tests.scrape import metric_in

# The first test's timeout covers the fixture: the (cached) build and four model loads.
pytestmark = [pytest.mark.compose, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
PROJECT = f"pdserve-test-{os.getpid()}"
QUESTION = "What is the capital of France?"
HEALTHY_WITHIN_S = 600.0  # four workers load the model at once on a small machine
METRICS_PORT = 9090  # the workers' --metrics-port in docker-compose.yml


def compose_command() -> list[str]:
    """``docker compose`` (v2) where the plugin exists, else ``docker-compose`` (1.x)."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    if v2.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed (compose/test.sh)")


def run(argv: list[str], timeout: float = 120.0, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@dataclass
class Stack:
    compose: list[str]
    env: dict[str, str]
    http_port: int
    prometheus_port: int

    def __call__(self, *args: str, timeout: float = 300.0) -> str:
        """A compose command on this project, the ``monitoring`` profile (Prometheus) on."""
        base = [*self.compose, "--profile", "monitoring", "-p", PROJECT, "-f", str(COMPOSE_FILE)]
        return run([*base, *args], timeout, self.env)

    def containers(self, service: str) -> list[str]:
        """Ids of the service's containers, running or not."""
        ids = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}",
                   "--filter", f"label=com.docker.compose.service={service}"])  # fmt: skip
        return ids.split()

    def health(self, container: str) -> str:
        fmt = "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}"
        return run(["docker", "inspect", "-f", fmt, container]).strip()

    def wait_healthy(self, counts: dict[str, int], within_s: float = HEALTHY_WITHIN_S) -> None:
        deadline = time.monotonic() + within_s
        while True:
            status = {s: [self.health(c) for c in self.containers(s)] for s in counts}
            if all(st.count("healthy") == counts[s] for s, st in status.items()):
                return
            if time.monotonic() > deadline:
                logs = self("logs", "--tail", "30", timeout=60)
                pytest.fail(f"not healthy within {within_s:.0f}s: {status}\n{logs}")
            time.sleep(3)

    def metric(
        self, container: str, name: str, labels: str = "", absent: float | None = None
    ) -> float:
        """A worker's metric, read inside its container (worker ports are not published)."""
        url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
        text = run(["docker", "exec", container, "python", "-c",
                    f"import urllib.request;print(urllib.request.urlopen({url!r},timeout=5)"
                    ".read().decode())"], timeout=30)  # fmt: skip
        return metric_in(text, name, labels, f"{container}:{METRICS_PORT}", absent)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="unused", timeout=120
        )


def leftovers() -> dict[str, str]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        kind: run(["docker", *cmd, "--filter", label]).strip()
        for kind, cmd in {
            "containers": ["ps", "-aq"],
            "networks": ["network", "ls", "-q"],
            "volumes": ["volume", "ls", "-q"],
        }.items()
    }


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.fail(f"no Docker engine answers (bash compose/test.sh starts one): {info.stderr}")
    run(["bash", str(ROOT / "compose" / "build.sh")], timeout=1800)
    ports = {name: free_port() for name in ("HTTP", "GRPC", "PROMETHEUS")}
    env = {**os.environ, **{f"PDSERVE_{name}_PORT": str(p) for name, p in ports.items()}}
    stack = Stack(compose_command(), env, ports["HTTP"], ports["PROMETHEUS"])
    try:
        stack("up", "-d", "--scale", "prefill=2", "--scale", "decode=2")
        stack.wait_healthy({"redis": 1, "kv-store": 1, "scheduler": 1, "prefill": 2, "decode": 2,
                            "gateway": 1, "prometheus": 1})  # fmt: skip
        yield stack
    finally:
        stack("down", "-v", "--remove-orphans", "--timeout", "60", timeout=600)
        assert leftovers() == {"containers": "", "networks": "", "volumes": ""}


def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def ask(client: openai.OpenAI, question: str = QUESTION, max_tokens: int = 24) -> str:
    reply = client.chat.completions.create(
        model=model(client), messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0,
    )  # fmt: skip
    return reply.choices[0].message.content or ""


def test_the_openai_sdk_is_served_through_the_published_port(stack: Stack) -> None:
    assert "Paris" in ask(stack.client())
    streamed = stack.client().chat.completions.create(
        model=model(stack.client()), messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24, temperature=0, stream=True,
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == ask(stack.client())


def test_the_workers_share_a_kv_store_across_containers(stack: Stack) -> None:
    """Every worker container mounts its DRAM into the store's pool; a prompt's full blocks,
    computed by one prefill container, are put there (over TCP between containers)."""
    workers = stack.containers("prefill") + stack.containers("decode")
    deadline = time.monotonic() + 60
    while not all(stack.metric(c, "pdserve:kv_store_connected") == 1 for c in workers):
        assert time.monotonic() < deadline, "a worker did not connect to the KV store"
        time.sleep(1)
    prefills = stack.containers("prefill")
    before = sum(stack.metric(c, "pdserve:kv_store_stored_blocks_total") for c in prefills)
    long_question = "Summarize: " + " ".join(f"fact {i} is about harbours." for i in range(40))
    assert ask(stack.client(), long_question, 8)
    deadline = time.monotonic() + 30
    while sum(stack.metric(c, "pdserve:kv_store_stored_blocks_total") for c in prefills) <= before:
        assert time.monotonic() < deadline, "no block reached the KV store"
        time.sleep(1)


def prometheus_get(stack: Stack, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{stack.prometheus_port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)["data"]


def test_prometheus_scrapes_every_service_and_replica(stack: Stack) -> None:
    """The monitoring profile's Prometheus, with deploy/prometheus/prometheus.yml, finds both
    replicas of each worker role by DNS and stores the metric names the dashboard reads."""
    want = {"gateway": 1, "scheduler": 1, "prefill": 2, "decode": 2}
    deadline = time.monotonic() + 120  # DNS refresh 15 s, scrape interval 5 s
    while True:
        targets = prometheus_get(stack, "/api/v1/targets")["activeTargets"]
        up = Counter(t["labels"]["job"] for t in targets if t["health"] == "up")
        if up == want:
            break
        assert time.monotonic() < deadline, f"targets up {dict(up)}, want {want}: {targets}"
        time.sleep(3)
    ask(stack.client())
    query = 'sum(pdserve:request_success_total{role="decode"})'
    deadline = time.monotonic() + 60
    while not (result := prometheus_get(stack, "/api/v1/query", query=query)["result"]):
        assert time.monotonic() < deadline, f"{query} has no samples"
        time.sleep(3)
    assert float(result[0]["value"][1]) >= 1


def test_a_new_decode_replica_takes_requests(stack: Stack) -> None:
    before = set(stack.containers("decode"))
    stack("up", "-d", "--no-recreate", "--scale", "prefill=2", "--scale", "decode=3")
    stack.wait_healthy({"decode": 3}, within_s=300)
    (new,) = set(stack.containers("decode")) - before
    # Placement prefers a replica that holds the prompt's prefix (every chat prompt shares
    # the template's) until it is busier than the rest: concurrent requests reach the new one.
    client = stack.client()
    served, sent = 0.0, 0
    for _ in range(3):
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda i: ask(client, f"Count to {i}.", 48), range(12)))
        assert all(replies)
        sent += len(replies)
        served = stack.metric(new, "pdserve:request_success_total", 'role="decode"', absent=0)
        if served > 0:
            break
    assert served > 0, f"the new decode replica {new[:12]} served none of {sent}"


def test_a_crashed_decode_container_loses_no_stream_and_restarts(stack: Stack) -> None:
    """Kill a decode container's process mid-stream: the request migrates and completes.

    The kill comes from the host (``kill -9`` of the container's PID 1), as a crash or the
    OOM killer would: ``docker kill`` marks a container stopped by hand, and Docker's restart
    policies deliberately never restart those.
    """
    client = stack.client()
    prompt = "Write a long story about a lighthouse keeper."
    expected = ask(client, prompt, max_tokens=96)
    stream = client.chat.completions.create(
        model=model(client), messages=[{"role": "user", "content": prompt}],
        max_tokens=96, temperature=0, stream=True,
    )  # fmt: skip
    pieces: list[str] = []
    victim = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if len(pieces) == 8 and not victim:
            running = {
                c: stack.metric(c, "pdserve:num_requests_running", 'role="decode"')
                for c in stack.containers("decode")
            }
            victim = max(running, key=lambda c: running[c])
            assert running[victim] == 1, running
            pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", victim]).strip()
            os.kill(int(pid), 9)
    assert victim, "the stream ended before the crash"
    assert "".join(pieces) == expected
    deadline = time.monotonic() + 300
    while int(run(["docker", "inspect", "-f", "{{.RestartCount}}", victim]).strip()) < 1:
        assert time.monotonic() < deadline, f"{victim[:12]} was not restarted"
        time.sleep(2)
    stack.wait_healthy({"decode": 3}, within_s=300)
    assert "Paris" in ask(client)

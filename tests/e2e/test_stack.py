"""End to end: redis-server, scheduler, gateway, 2 prefill and 2 decode workers, as real
processes started by ``pdserve up``'s launcher; clients are the official ``openai`` client
over HTTP and a gRPC streaming client.

One decode worker takes KV over shm, the other over tcp, so every check runs both paths.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import openai
import pytest
import redis

from engine.sampling_params import SamplingParams
from pdserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.launcher import REDIS_USER, Stack, free_port, redis_password_file
from services.supervisor import RestartPolicy, Supervisor
from services.up import assign_cores, launch, load_up_config, worker_placement
from tests.e2e.supervision import supervised
from tests.scrape import metric

MAX_TOKENS = 16
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give me a fun fact about owls.",
    "What does a compiler do?",
    "List two uses of copper.",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = load_up_config(
        ["--prefill", "2", "--decode", "2", "--transport", "shm,tcp", "--kv-cache-mib", "96",
         "--http-port", str(free_port()), "--grpc-port", str(free_port()),
         "--heartbeat-ttl-s", "2", "--pin", "--control-cpus", "0",
         "--local-prefill-max-tokens", "0"], {}  # every prompt crosses a transport
    )  # fmt: skip
    # A short prefill deadline: the KV lease of a killed prefill worker's requests is short;
    # a short drain: a drained decode worker cuts its streams soon.
    st = Stack(
        log_dir=tmp_path_factory.mktemp("stack"),
        env={"PDSERVE_DECODE_PREFILL_DEADLINE_S": "10", "PDSERVE_DECODE_DRAIN_TIMEOUT_S": "0.5"},
    )
    try:
        endpoints = launch(args, st)
        yield st, endpoints
    finally:
        st.stop()


def _client(endpoints) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoints["http"], api_key="unused", max_retries=0)


async def _model(client: openai.AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def _chat(client, model: str, q: str, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": q}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    text, reason = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


def _engine_thread_cores(pid: int) -> list[set[int]]:
    """The cores of each thread of process ``pid`` the OS calls ``pdserve-engine``."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/comm") as f:
            if f.read().strip() == "pdserve-engine":
                found.append(os.sched_getaffinity(int(task)))
    return found


def test_pinning_puts_each_worker_on_its_core_and_the_control_plane_on_core_0(
    stack,
) -> None:
    st, _ = stack
    cores = sorted(os.sched_getaffinity(0))
    workers = [p for p in st.procs if p.name.startswith(("prefill-", "decode-"))]
    assert [p.name for p in workers] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    plan = assign_cores([p.name for p in workers], cores, {0})
    if cores == [0, 1]:  # CI's and this project's machines: decode workers first, off core 0
        assert plan == {"decode-0": 1, "decode-1": 0, "prefill-0": 1, "prefill-1": 0}
    for p in workers:
        assert p.popen is not None
        # the engine thread on its core; the process there too, plus control cores no worker
        # computes on (none on 2 cores: 4 workers)
        cores_of_process, _ = worker_placement(p.name, plan, {0})
        if cores == [0, 1]:
            assert cores_of_process == {plan[p.name]}
        assert os.sched_getaffinity(p.popen.pid) == cores_of_process, p.name
        assert _engine_thread_cores(p.popen.pid) == [{plan[p.name]}], p.name
    for p in st.procs:
        if p.name in ("redis", "scheduler", "gateway"):
            assert p.popen is not None
            assert os.sched_getaffinity(p.popen.pid) == {0}, p.name


@pytest.fixture(scope="module")
def expected(make_engine, default_tokenizer) -> dict[str, str]:
    engine = make_engine()
    tok = default_tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS]  # fmt: skip
    res = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {q: r.text for q, r in zip(QUESTIONS, res, strict=True)}


def _kv_bytes(endpoints, name: str = "pdserve:kv_transfer_bytes_total") -> dict[str, float]:
    """``name`` (by default the KV bytes received) of each decode worker."""
    return {
        k.split(":", 1)[1]: metric(v, name)
        for k, v in endpoints.items()
        if k.startswith("metrics:decode")
    }


def _kv_usage(endpoints) -> dict[str, float]:
    return {
        k.split(":", 1)[1]: metric(v, "pdserve:kv_cache_usage_perc")
        for k, v in endpoints.items()
        if k.startswith("metrics:")
    }


async def _all_free(endpoints, timeout: float = 1.0) -> dict[str, float]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        usage = _kv_usage(endpoints)
        if all(v == 0.0 for v in usage.values()) or asyncio.get_running_loop().time() > deadline:
            return usage
        await asyncio.sleep(0.05)


async def test_openai_client_streams_the_real_answer(stack) -> None:
    _, endpoints = stack
    client = _client(endpoints)
    text, reason = await _chat(client, await _model(client), "What is the capital of France?")
    assert "Paris" in text
    assert reason == "stop"


async def test_the_stack_serves_with_a_cluster_token_its_scheduler_demands(stack) -> None:
    st, endpoints = stack
    assert len(st.env["PDSERVE_CLUSTER_TOKEN"]) >= 32  # pdserve up's own, per stack
    async with grpc.aio.insecure_channel(endpoints["scheduler"]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await scheduler_pb2_grpc.SchedulerStub(ch).Place(
                scheduler_pb2.PlaceRequest(request_id="x", prompt_tokens=1, max_tokens=1),
                timeout=5,
            )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # ...and every internal hop of a real request carried it: placed, prefilled remotely
    # under a placement token, decoded
    client = _client(endpoints)
    text, _ = await _chat(client, await _model(client), "What is the capital of France?")
    assert "Paris" in text


async def test_32_concurrent_clients_equal_colocated_over_shm_and_tcp(
    stack, expected, default_tokenizer
) -> None:
    _, endpoints = stack
    client = _client(endpoints)
    model = await _model(client)
    present = "pdserve:prompt_tokens_cached_total"
    before, present_before = _kv_bytes(endpoints), _kv_bytes(endpoints, present)
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(32)]
    results = await asyncio.wait_for(asyncio.gather(*(_chat(client, model, q) for q in qs)), 240)
    for q, (text, _) in zip(qs, results, strict=True):
        assert text == expected[q], q
    after, present_after = _kv_bytes(endpoints), _kv_bytes(endpoints, present)
    moved = {k: after[k] - before[k] for k in after}
    assert all(v > 0 for v in moved.values()), f"a decode worker got no KV: {moved}"
    # Blocks a decode worker already held (a repeated question's, the shared system
    # prompt's) were not sent: its reservations' num_present_tokens.
    skipped = sum(present_after[k] - present_before[k] for k in after) // 16
    tok = default_tokenizer
    block_bytes = 16 * 3 * 64 * 2  # float16: the workers' default KV dtype on the CPU
    blocks = sum(
        -(-len(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))) // 16)
        for q in qs
    )
    assert sum(moved.values()) == (blocks - skipped) * block_bytes * 2 * 30
    usage = await _all_free(endpoints)
    assert all(v == 0.0 for v in usage.values()), usage


async def test_grpc_generate_stream(stack, expected) -> None:
    _, endpoints = stack
    async with grpc.aio.insecure_channel(endpoints["grpc"]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        req = gateway_pb2.GenerateRequest(
            chat=common_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role="user", content=QUESTIONS[0])]
            ),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        )
        text, last, stamps = [], None, []
        sent_ns = time.time_ns()
        async for ev in stub.Generate(req, timeout=60):
            text.append(ev.text)
            stamps.append((ev.produced_unix_ns, time.time_ns()))
            last = ev
    assert "".join(text) == expected[QUESTIONS[0]]
    assert last is not None and last.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    # every event carries the decode worker's stamp: after the request was sent, before it
    # arrived here (one host, one clock), and in order
    assert all(sent_ns < produced <= received for produced, received in stamps), stamps
    assert [p for p, _ in stamps] == sorted(p for p, _ in stamps)


async def test_two_clients_choosing_the_same_request_id_do_not_collide(stack, expected) -> None:
    """A gRPC client chooses its request_id: one that another client uses at the same time
    must not share its placement (the scheduler's Place is idempotent per id) or end its
    reservations; both streams are answered in full, each echoing its id."""
    _, endpoints = stack

    async def ask(question: str) -> tuple[str, set[str]]:
        async with grpc.aio.insecure_channel(endpoints["grpc"]) as ch:
            req = gateway_pb2.GenerateRequest(
                request_id="same-id",
                chat=common_pb2.ChatMessages(
                    messages=[common_pb2.ChatMessage(role="user", content=question)]
                ),
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            )
            events = [ev async for ev in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)]
        return "".join(ev.text for ev in events), {ev.request_id for ev in events}

    answers = await asyncio.gather(ask(QUESTIONS[0]), ask(QUESTIONS[1]))
    assert [text for text, _ in answers] == [expected[QUESTIONS[0]], expected[QUESTIONS[1]]]
    assert all(ids == {"same-id"} for _, ids in answers)


async def test_client_disconnect_frees_blocks_on_both_workers(stack) -> None:
    _, endpoints = stack
    client = _client(endpoints)
    model = await _model(client)
    streams = [
        await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell a very long story number {i}."}],
            max_tokens=1000,
            temperature=0,
            stream=True,
        )
        for i in range(4)
    ]
    for s in streams:
        n = 0
        async for _ in s:
            n += 1
            if n == 3:
                break
    assert any(v > 0 for v in _kv_usage(endpoints).values())
    for s in streams:
        await s.close()
    usage = await _all_free(endpoints, timeout=1.0)
    assert all(v == 0.0 for v in usage.values()), usage


async def test_bad_input_is_a_clear_4xx_and_the_stack_survives(stack) -> None:
    _, endpoints = stack
    client = _client(endpoints)
    model = await _model(client)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await client.completions.create(model=model, prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt="x " * 9000, max_tokens=1)
    text, _ = await _chat(client, model, QUESTIONS[3])
    assert text


LONG = 96  # tokens per stream in the kill and drain tests: a stream outlasts a 0.5 s drain
POEMS = [f"Write a long poem about the number {i}." for i in range(4)]


@pytest.fixture(scope="module")
def expected_long(make_engine, default_tokenizer) -> dict[str, str]:
    tok = default_tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in POEMS]  # fmt: skip
    res = make_engine().generate(prompts, SamplingParams(max_tokens=LONG, temperature=0.0))
    return {q: r.text for q, r in zip(POEMS, res, strict=True)}


async def _chat_counting(client, model: str, q: str, seen: list[int], i: int) -> str:
    """A greedy streamed chat that counts its content chunks in ``seen[i]``."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": q}],
        max_tokens=LONG,
        temperature=0,
        stream=True,
    )
    text = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            seen[i] += 1
    return "".join(text)


async def _poems_streaming(endpoints) -> list[asyncio.Future[str]]:
    """The POEMS as greedy streams, returned once every one has produced a few chunks."""
    client = _client(endpoints)
    model = await _model(client)
    seen = [0] * len(POEMS)
    streams = [
        asyncio.ensure_future(_chat_counting(client, model, q, seen, i))
        for i, q in enumerate(POEMS)
    ]
    deadline = time.monotonic() + 120
    while min(seen) < 3:
        assert time.monotonic() < deadline, seen
        assert not any(s.done() for s in streams), [s for s in streams if s.done()]
        await asyncio.sleep(0.02)
    return streams


def _running(endpoints, worker: str) -> float:
    """Requests in ``worker``'s running batch, from its /metrics."""
    url = endpoints[f"metrics:{worker}"]
    return metric(url, "pdserve:num_requests_running", 'role="decode"')


def _gateway_metric(endpoints, name: str, labels: str = "") -> float:
    return metric(endpoints["http"].removesuffix("/v1") + "/metrics", name, labels)


async def test_killed_decode_worker_streams_migrate_with_identical_greedy_text(
    stack, expected, expected_long
) -> None:
    """kill -9 of a decode worker mid-stream: its streams are placed again with the tokens
    the client already has and finish on the other worker: one stream each, the same greedy
    text as an uninterrupted run."""
    st, endpoints = stack
    client = _client(endpoints)
    model = await _model(client)
    victim = st.named("decode-1")
    before = _gateway_metric(endpoints, "pdserve:migrations_total", 'cause="decode_lost"')
    streams = await _poems_streaming(endpoints)  # every stream is producing: kill mid-stream
    assert victim.popen is not None
    victim.popen.kill()
    texts = await asyncio.wait_for(asyncio.gather(*streams), 180)
    assert texts == [expected_long[q] for q in POEMS]
    moved = _gateway_metric(endpoints, "pdserve:migrations_total", 'cause="decode_lost"')
    # the scheduler spreads the four over both decode workers: the victim's moved
    assert moved - before >= 1
    # survivors serve new requests too (the victim stays dead until the next test)
    results = await asyncio.gather(*(_chat(client, model, q) for q in QUESTIONS[:4]))
    assert [t for t, _ in results] == [expected[q] for q in QUESTIONS[:4]]


# Long enough to kill a prefill worker mid-compute; small enough that, with the decode
# worker killed by the test before this one, the survivor holds them all (and the blocks
# leased to the killed prefill worker's writes).
LONG_PROMPTS = [f"Summarize this, part {i}: " + "the tide comes in and goes out. " * 35
                for i in range(3)]  # fmt: skip


@pytest.fixture(scope="module")
def expected_long_prompts(make_engine, default_tokenizer) -> dict[str, str]:
    tok = default_tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in LONG_PROMPTS]  # fmt: skip
    res = make_engine().generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {q: r.text for q, r in zip(LONG_PROMPTS, res, strict=True)}


async def test_killed_prefill_worker_mid_transfer_its_requests_complete(
    stack, expected_long_prompts
) -> None:
    """kill -9 of a prefill worker while it computes and writes long prompts: the decode
    workers' Prefill calls fail, name the prefill worker, and the gateway places those
    requests again on the other one: every request completes with the greedy text."""
    st, endpoints = stack
    client = _client(endpoints)
    model = await _model(client)
    victim = st.named("prefill-1")
    metrics_url = endpoints["metrics:prefill-1"]
    started = metric(metrics_url, "pdserve:request_queue_time_seconds_count")
    before = _gateway_metric(endpoints, "pdserve:migrations_total", 'cause="prefill_lost"')
    chats = [asyncio.ensure_future(_chat(client, model, q)) for q in LONG_PROMPTS]
    deadline = time.monotonic() + 120
    # kill it as soon as a prompt of this batch reached its engine: mid-compute or transfer
    while metric(metrics_url, "pdserve:request_queue_time_seconds_count") == started:
        assert time.monotonic() < deadline
        assert not any(c.done() for c in chats), [c for c in chats if c.done()]
        await asyncio.sleep(0.01)
    assert victim.popen is not None
    victim.popen.kill()
    results = await asyncio.wait_for(asyncio.gather(*chats), 180)
    assert [t for t, _ in results] == [expected_long_prompts[q] for q in LONG_PROMPTS]
    moved = _gateway_metric(endpoints, "pdserve:migrations_total", 'cause="prefill_lost"')
    assert moved - before >= 1


def _live_segments() -> dict[str, bool]:
    """Every KV segment in /dev/shm and whether its owner process still holds it."""
    import fcntl

    out: dict[str, bool] = {}
    for name in os.listdir("/dev/shm"):
        if not name.startswith("pdserve-kv-"):
            continue
        path = os.path.join("/dev/shm", name)
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                out[path] = True
            else:
                out[path] = False
    return out


async def test_the_supervisor_restarts_dead_workers_and_the_stack_serves_on(
    stack, expected
) -> None:
    """What ``pdserve up`` does while it runs: dead workers come back (the shm one clears its
    predecessor's segment as it starts) and every request is served again."""
    st, endpoints = stack
    said: list[str] = []
    workers = [p.name for p in st.procs if p.name.startswith(("prefill-", "decode-"))]
    supervisor = Supervisor(st, workers, RestartPolicy(first_delay_s=0.2), said.append)

    async def supervise_until_ready(name: str) -> None:
        proc = st.named(name)
        deadline = time.monotonic() + 120
        while not (proc.popen is not None and proc.popen.poll() is None and proc.ready.is_set()):
            assert supervisor.tick() is None
            assert time.monotonic() < deadline, said
            await asyncio.sleep(0.2)

    # decode-1 was killed by the test before this one (if it ran alone: kill it now).
    victim = st.named("decode-1")
    if victim.popen is not None and victim.popen.poll() is None:
        victim.popen.kill()
        victim.popen.wait(10)
    await supervise_until_ready("decode-1")
    # Now the shm decode worker: SIGKILL leaves its segment behind.
    before = _live_segments()
    st.named("decode-0").popen.kill()  # type: ignore[union-attr]
    st.named("decode-0").popen.wait(10)  # type: ignore[union-attr]
    orphans = [p for p, alive in _live_segments().items() if not alive and before.get(p)]
    assert len(orphans) == 1, (before, _live_segments())
    await supervise_until_ready("decode-0")
    assert not os.path.exists(orphans[0])
    assert any(line.startswith("decode-0 restarted") for line in said), said
    # Both restarted workers registered again (same worker ids): every answer is served.
    client = _client(endpoints)
    model = await _model(client)
    deadline = time.monotonic() + 30
    while True:
        try:
            results = await asyncio.gather(*(_chat(client, model, q) for q in QUESTIONS))
            break
        except openai.APIError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)
    assert [t for t, _ in results] == [expected[q] for q in QUESTIONS]


async def _served_within(client, model: str, timeout_s: float) -> float:
    """Seconds until a request is answered again (retrying while the stack recovers)."""
    started = time.monotonic()
    while True:
        try:
            text, _ = await _chat(client, model, QUESTIONS[0])
            assert text
            return time.monotonic() - started
        except openai.APIError:
            assert time.monotonic() - started < timeout_s, "not served again in time"
            await asyncio.sleep(0.2)


async def test_a_drained_decode_worker_streams_migrate_at_its_drain_deadline(
    stack, expected_long
) -> None:
    """SIGTERM to a decode worker: it takes no new work, and the streams it still runs at
    its drain deadline (0.5 s here) are cut; the gateway moves them, the text unbroken."""
    st, endpoints = stack
    before = _gateway_metric(endpoints, "pdserve:migrations_total", 'cause="decode_lost"')
    streams = await _poems_streaming(endpoints)
    # The decode worker running the most of them (placement may put them all on one), read
    # once the gauges count exactly these streams: a gauge still showing an earlier test's
    # streams (published every 0.1 s) could pick a worker with none, which would drain
    # without a migration.
    alive = [
        p for p in st.procs if p.name.startswith("decode-") and p.popen and p.popen.poll() is None
    ]
    deadline = time.monotonic() + 30
    while True:
        running = {p.name: _running(endpoints, p.name) for p in alive}
        victim = max(alive, key=lambda p: running[p.name])
        if sum(running.values()) == len(streams):
            break
        assert time.monotonic() < deadline, running
        await asyncio.sleep(0.05)
    assert victim.popen is not None
    victim.popen.terminate()
    texts = await asyncio.wait_for(asyncio.gather(*streams), 180)
    assert texts == [expected_long[q] for q in POEMS]
    assert victim.popen.wait(30) == 0  # a drain, not a crash
    moved = _gateway_metric(endpoints, "pdserve:migrations_total", 'cause="decode_lost"')
    assert moved - before >= 1


async def test_a_killed_redis_is_restarted_and_requests_are_served_throughout(
    stack, expected
) -> None:
    st, endpoints = stack
    client = _client(endpoints)
    model = await _model(client)
    # The stack's Redis takes only its ACL user, with the password pdserve up keeps.
    r = redis.Redis.from_url(
        endpoints["redis"], decode_responses=True, socket_timeout=2, username=REDIS_USER,
        password=redis_password_file(Path(endpoints["logs"])).read_text(),
    )  # fmt: skip
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(endpoints["redis"], socket_timeout=2).ping()
    await _chat(client, model, QUESTIONS[1])
    await asyncio.sleep(1.5)  # the append-only file is fsynced every second
    records = set(r.scan_iter("pdserve:request:*"))
    assert records
    said: list[str] = []
    # The workers serving now (a test before may have drained or killed some) must be in
    # the registry again once Redis is back.
    running = [
        f"pdserve:worker:{p.name}"
        for p in st.procs
        if p.name.startswith(("prefill-", "decode-")) and p.popen and p.popen.poll() is None
    ]
    assert running
    victim = st.named("redis")
    assert victim.popen is not None
    victim.popen.kill()
    victim.popen.wait(5)
    killed = time.monotonic()
    # Redis down, nothing restarted yet: placement goes on from the scheduler's memory.
    text, _ = await _chat(client, model, QUESTIONS[2])
    assert text == expected[QUESTIONS[2]]
    async with supervised(st, said):
        took = await _served_within(client, model, timeout_s=10)
        # Restarted and serving: until the supervisor restarts it, ``popen`` is the killed
        # process and ``ready`` still says what it said before the kill.
        while victim.popen.poll() is not None or not victim.ready.is_set():
            assert time.monotonic() - killed < 10, said
            await asyncio.sleep(0.1)
        # Back: the records it held (its append-only file) and the registry (re-mirrored).
        while not all(r.exists(key) for key in running):
            missing = [key for key in running if not r.exists(key)]
            assert time.monotonic() - killed < 10, f"not written again: {missing}; {said}"
            await asyncio.sleep(0.1)
        assert records <= set(r.scan_iter("pdserve:request:*"))
        results = await asyncio.gather(*(_chat(client, model, q) for q in QUESTIONS))
    assert [t for t, _ in results] == [expected[q] for q in QUESTIONS]
    assert any(line.startswith("redis restarted") for line in said), said
    r.close()
    print(f"redis kill -9: served again {took:.2f} s later")


async def test_a_killed_scheduler_leaves_streams_running_and_comes_back(stack, expected) -> None:
    st, endpoints = stack
    client = _client(endpoints)
    model = await _model(client)
    said: list[str] = []
    victim = st.named("scheduler")
    async with supervised(st, said):
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Write a long poem about the sea."}],
            max_tokens=120,
            temperature=0,
            stream=True,
        )
        chunks, reason, back = 0, None, None
        async for chunk in stream:
            chunks += 1
            if chunks == 3:  # mid-stream: the scheduler dies
                assert victim.popen is not None
                victim.popen.kill()
                victim.popen.wait(5)
                back = asyncio.create_task(_served_within(client, model, timeout_s=30))
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
        assert chunks > 3 and reason in ("length", "stop")  # it never needed the scheduler
        assert back is not None
        took = await back
        results = await asyncio.gather(*(_chat(client, model, q) for q in QUESTIONS))
    assert [t for t, _ in results] == [expected[q] for q in QUESTIONS]
    assert any(line.startswith("scheduler restarted") for line in said), said
    print(f"scheduler kill -9: served again {took:.2f} s later")

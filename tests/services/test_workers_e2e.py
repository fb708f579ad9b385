"""Prefill and decode workers as real processes over real gRPC, KV over shm and tcp.

Greedy output of the disaggregated path equals the colocated engine's, token for token;
the KV bytes moved equal the size of the prompt blocks the decode worker did not already
hold (a conversation's next turn reuses the last turn's prompt and output blocks there);
cancelled and finished requests leave every block free; bad input gets a clear status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.kv_cache import KVCacheSpec
from engine.sampling_params import SamplingParams
from engine.structured import StructuredKind, StructuredOutput
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import cluster_auth
from services.common.convert import handle_to_proto, kv_fenced, structured_to_proto
from tests.scrape import metric
from tests.services.procs import ServiceProcess, start_unscheduled
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.registry import get_transport

MAX_TOKENS = 12
# Bytes of one KV block of one layer's K or V: tokens x kv heads x head dim x float16 (the
# workers' default KV dtype on the CPU).
BLOCK_BYTES = 16 * 3 * 64 * 2
BLOCK_ALL_LAYERS = BLOCK_BYTES * 2 * 30  # K and V of every layer: what moving a block costs
# The decode workers' prefill deadline; with 2 s of grace, the KV lease of a failed prefill.
PREFILL_DEADLINE_S = 10.0
KV_MIB = "48"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    procs: dict[str, ServiceProcess] = {}
    ports = {}
    try:
        for name, args in (
            ("shm", ["--transport", "shm"]),
            ("tcp", ["--transport", "tcp"]),
            ("mooncake", ["--transport", "mooncake", "--mooncake-protocol", "tcp"]),
        ):
            ports[name] = _free_port()
            # Throughput mode: test_concurrent_streams runs more at once than a default
            # batch target takes (its reservations past it would be refused).
            procs[name] = start_unscheduled(
                "services.decode", "--port", "0", "--kv-cache-mib", KV_MIB,
                "--prefill-deadline-s", str(PREFILL_DEADLINE_S), "--itl-target-ms", "0",
                "--metrics-port", str(ports[name]), *args,
            )  # fmt: skip
        ports["prefill"] = _free_port()
        procs["prefill"] = start_unscheduled(
            "services.prefill", "--port", "0", "--kv-cache-mib", KV_MIB,
            "--metrics-port", str(ports["prefill"]), "--transports", "shm,tcp,mooncake",
        )  # fmt: skip
        yield procs, ports
    finally:
        for p in procs.values():
            p.stop()


def _metric(port: int, name: str) -> float:
    return metric(f"http://127.0.0.1:{port}/metrics", name)


async def _wait_metric(port: int, name: str, want: float, timeout: float = 10.0) -> float:
    """Poll a worker's series until it reads ``want`` (the gauges are published every 0.1 s
    by the worker's event loop, which a loaded 2-core CI host can hold off for a while)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        v = _metric(port, name)
        if v == want or asyncio.get_running_loop().time() > deadline:
            return v
        await asyncio.sleep(0.05)


def _request(
    rid: str, ids: list[int], prefill: str, **sampling
) -> worker_pb2.DecodeGenerateRequest:
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("temperature", 0.0)
    return worker_pb2.DecodeGenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(ignore_eos=True, **sampling),
        prefill_address=prefill,
    )


async def _generate(address: str, req) -> tuple[list[int], worker_pb2.DecodeEvent]:
    async with cluster_auth.channel(address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        toks: list[int] = []
        last = None
        async for ev in stub.Generate(req, timeout=120):
            toks.extend(ev.token_ids)
            last = ev
        return toks, last


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    tok = default_tokenizer
    qs = ["What is the capital of France?", "Name three fruits.", "Write a haiku about rain."]
    out = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in qs]
    out.append(tok.encode("def fibonacci(n):\n    " * 12))  # ~100 tokens, several blocks
    return out


@pytest.fixture(scope="module")
def expected(make_engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in make_engine().generate(prompts, params)]


async def test_penalties_bias_and_min_tokens_cross_the_workers(
    cluster, prompts, make_engine
) -> None:
    """The prefill worker samples the first token and the decode worker the rest, both with
    the request's penalties, bias and min_tokens: the colocated engine's tokens."""
    procs, _ = cluster
    changes = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
               "logit_bias": {13: -5.0, 30: 2.0}, "min_tokens": 6}  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **changes)
    want = [r.token_ids for r in make_engine().generate(prompts[:2], params)]
    got = await asyncio.gather(
        *(
            _generate(procs["shm"].address, _request(f"pen-{i}", ids, procs["prefill"].address,
                                                     **changes))
            for i, ids in enumerate(prompts[:2])
        )
    )  # fmt: skip
    assert [toks for toks, _ in got] == want
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert want != [r.token_ids for r in make_engine().generate(prompts[:2], plain)]


async def _events(address: str, req) -> list[worker_pb2.DecodeEvent]:
    async with cluster_auth.channel(address) as ch:
        return [ev async for ev in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=120)]


async def test_top_logprobs_and_a_kept_stop_string_cross_the_workers(
    cluster, prompts, make_engine
) -> None:
    """The first token's alternatives come from the prefill worker, the rest from the decode
    worker: the colocated engine's (the workers' quantized weights and float16 KV round the
    last digits differently), and the stop string stays in the text as asked."""
    procs, _ = cluster
    colocated = make_engine()
    want = colocated.generate(prompts[:1], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True,
        top_logprobs=5))[0]  # fmt: skip
    stop = colocated.tokenizer.decode(want.token_ids[3:5])
    events = await _events(procs["shm"].address, _request(
        "top-5", prompts[0], procs["prefill"].address, logprobs=True, top_logprobs=5,
        stop=[stop], include_stop_str_in_output=True))  # fmt: skip
    tops = [t for ev in events for t in ev.top_logprobs]
    tokens = [t for ev in events for t in ev.token_ids]
    assert tokens == want.token_ids[: len(tokens)] and len(tops) == len(tokens) == 5
    for got, exp in zip(tops, want.top_logprobs, strict=False):
        assert list(got.token_ids)[:3] == list(exp.token_ids)[:3]  # no near-ties up there
        assert list(got.logprobs) == pytest.approx(exp.logprobs, abs=2e-3)
        assert set(got.token_ids) == set(exp.token_ids)
    text = "".join(ev.text for ev in events)
    assert text.endswith(stop) and text == want.text[: want.text.find(stop) + len(stop)]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5}],
                         ids=["greedy", "seeded"])  # fmt: skip
async def test_a_structured_output_crosses_the_workers(
    cluster, prompts, make_engine, sampling
) -> None:
    """The prefill worker masks the first token with the request's grammar; the decode
    worker replays that token into its own matcher and masks the rest: the colocated
    engine's tokens, ended by the grammar."""
    procs, _ = cluster
    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Rome", "yes"]}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    so = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, structured=so, **sampling)
    want = make_engine().generate(prompts[:2], params)
    got = await asyncio.gather(
        *(
            _generate(procs["shm"].address, _request(
                f"json-{i}-{len(sampling)}", ids, procs["prefill"].address,
                structured=structured_to_proto(so), **sampling))
            for i, ids in enumerate(prompts[:2])
        )
    )  # fmt: skip
    assert [toks for toks, _ in got] == [r.token_ids for r in want]
    for (_, last), r in zip(got, want, strict=True):
        assert r.finish_reason == "stop" and json.loads(r.text)["answer"]
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize("transport", ["shm", "tcp", "mooncake"])
async def test_disaggregated_equals_colocated(cluster, prompts, expected, transport) -> None:
    procs, ports = cluster
    dec, pre = procs[transport], procs["prefill"]
    before = _metric(ports[transport], "pdserve:kv_transfer_bytes_total")
    present_before = _metric(ports[transport], "pdserve:prompt_tokens_cached_total")
    overlap = f"http://127.0.0.1:{ports['prefill']}/metrics", f'transport="{transport}"'
    overlaps_before = metric(overlap[0], "pdserve:kv_transfer_overlap_ratio_count", overlap[1])
    results = await asyncio.gather(
        *(
            _generate(dec.address, _request(f"{transport}-{i}", ids, pre.address))
            for i, ids in enumerate(prompts)
        )
    )
    assert [toks for toks, _ in results] == expected
    # the blocks the decode worker already held (a prompt's prefix another of them, or a
    # request of an earlier test, left in its cache) were not sent
    present = _metric(ports[transport], "pdserve:prompt_tokens_cached_total") - present_before
    assert present % 16 == 0
    want = (sum(-(-len(ids) // 16) for ids in prompts) - present // 16) * BLOCK_ALL_LAYERS
    assert sum(last.kv_transfer_bytes for _, last in results) == want
    after = _metric(ports[transport], "pdserve:kv_transfer_bytes_total")
    assert after - before == want
    # each transfer's layer-wise overlap, a share in [0, 1], is observed once per request
    overlaps = metric(overlap[0], "pdserve:kv_transfer_overlap_ratio_count", overlap[1])
    assert overlaps - overlaps_before == len(prompts)
    ratio_sum = metric(overlap[0], "pdserve:kv_transfer_overlap_ratio_sum", overlap[1])
    assert 0.0 <= ratio_sum <= overlaps
    # every engine step is timed: decode steps here, prefill batches on the prefill worker
    assert _metric(ports[transport], "pdserve:engine_step_seconds_count") >= MAX_TOKENS - 1
    assert _metric(ports["prefill"], "pdserve:engine_step_seconds_count") >= 1
    assert _metric(ports[transport], "pdserve:engine_delivery_wait_timeouts_total") >= 0
    for _, last in results:
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == MAX_TOKENS
    assert await _wait_metric(ports[transport], "pdserve:kv_cache_usage_perc", 0.0) == 0.0


def test_workers_state_their_weight_format_and_memory_on_ready(cluster) -> None:
    # --weights auto: packed blocks on decode workers, dense float32 on the prefill worker;
    # `pdserve up` prints these fields. Default model: 96.6 MB of GGUF tensors, 621 MiB dense.
    procs, _ = cluster

    def fields(name: str) -> dict[str, str]:
        return dict(part.split("=", 1) for part in procs[name].ready_line.split() if "=" in part)

    for name in ("shm", "tcp"):
        ready = fields(name)
        assert ready["weights"] == "quantized"
        assert 90 < float(ready["weight_mib"]) <= 1.25 * 96.6e6 / 2**20
        assert float(ready["kv_mib"]) == pytest.approx(float(KV_MIB), rel=0.01)
    prefill = fields("prefill")
    assert prefill["weights"] == "float32" and float(prefill["weight_mib"]) > 500


async def test_concurrent_streams(cluster, prompts, expected) -> None:
    procs, _ = cluster
    reqs = [(i % len(prompts), f"c{i}") for i in range(16)]
    results = await asyncio.gather(
        *(
            _generate(procs["shm"].address, _request(rid, prompts[k], procs["prefill"].address))
            for k, rid in reqs
        )
    )
    assert [toks for toks, _ in results] == [expected[k] for k, _ in reqs]


async def test_cancel_frees_blocks_on_both_workers(cluster, prompts) -> None:
    procs, ports = cluster
    req = _request("cancel-me", prompts[3], procs["prefill"].address, max_tokens=500)
    async with cluster_auth.channel(procs["shm"].address) as ch:
        call = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=120)
        n = 0
        async for _ in call:
            n += 1
            if n == 3:
                break
        call.cancel()
    assert await _wait_metric(ports["shm"], "pdserve:kv_cache_usage_perc", 0.0) == 0.0
    assert await _wait_metric(ports["prefill"], "pdserve:kv_cache_usage_perc", 0.0) == 0.0


async def test_cancel_during_the_prefill_frees_blocks_on_both_workers(
    cluster, default_tokenizer
) -> None:
    """Cancelled while the prefill worker computes and writes the KV: it aborts the transfer,
    releases its blocks once the writer stopped, and the decode worker frees its own."""
    procs, ports = cluster
    ids = default_tokenizer.encode("Tell me everything about the sea. " * 120)  # ~1,000 tokens
    req = _request("cancel-in-prefill", ids, procs["prefill"].address, max_tokens=50)
    async with cluster_auth.channel(procs["shm"].address) as ch:
        call = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=120)
        await asyncio.sleep(0.3)  # the prompt is being computed
        call.cancel()
    # Both pools empty again: nothing leaked on either side (a prefix stays cached but
    # unreferenced, which the usage gauge does not count).
    assert await _wait_metric(ports["prefill"], "pdserve:kv_cache_usage_perc", 0.0, 15.0) == 0.0
    assert await _wait_metric(ports["shm"], "pdserve:kv_cache_usage_perc", 0.0, 15.0) == 0.0
    toks, _ = await _generate(
        procs["shm"].address, _request("after-cancel", ids[:40], procs["prefill"].address)
    )
    assert len(toks) == MAX_TOKENS


async def test_a_short_prompt_is_answered_without_waiting_for_a_long_ones_prefill(
    cluster, default_tokenizer, prompts
) -> None:
    """The prefill worker replies once a prompt's KV is confirmed; releasing its blocks
    (a command to the engine thread, busy with the next prompt) happens after the reply."""
    procs, _ = cluster
    long_ids = default_tokenizer.encode("Tell me everything about mountains. " * 110)
    loop = asyncio.get_running_loop()
    firsts: dict[str, float] = {}

    async def first_token(rid: str, ids: list[int]) -> None:
        req = _request(rid, ids, procs["prefill"].address, max_tokens=2)
        async with cluster_auth.channel(procs["shm"].address) as ch:
            async for _ in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=120):
                firsts.setdefault(rid, loop.time())

    short = asyncio.ensure_future(first_token("short", prompts[0]))
    await asyncio.sleep(0.05)  # the long prompt arrives while the short one computes
    long_sent = loop.time()
    await asyncio.gather(short, first_token("long", long_ids))
    # Had the short reply waited for the long prompt's prefill, it would come at the end of
    # that prefill; it must come in its first half (a ratio, so a faster host passes too).
    long_wait = firsts["long"] - long_sent
    assert firsts["short"] - long_sent < 0.5 * long_wait, (firsts, long_sent)


def test_a_decode_worker_removes_stale_kv_segments_at_start() -> None:
    """A segment whose owner died (nobody holds its lock) goes; a live owner's stays."""
    import uuid
    from pathlib import Path

    from transfer import KVLayout
    from transfer.shm import ShmTransport

    stale = Path("/dev/shm") / f"pdserve-kv-stale-{uuid.uuid4().hex}"
    stale.write_bytes(b"\0" * 4096)
    layout = KVLayout(
        num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32"
    )
    with ShmTransport() as transport:
        live = transport.register(layout)
        worker = start_unscheduled(
            "services.decode", "--port", "0", "--kv-cache-mib", "16", "--transport", "shm"
        )
        try:
            assert not stale.exists()
            assert Path(live.handle.address).exists()
            assert any("stale_kv_segment_removed" in line for line in worker.output)
        finally:
            worker.stop()
            stale.unlink(missing_ok=True)


async def test_bad_input_gets_invalid_argument(cluster, prompts) -> None:
    procs, _ = cluster
    dec = procs["shm"].address
    cases = [
        _request("", prompts[0], ""),
        _request("empty", [], ""),
        _request("topp", prompts[0], "", top_p=2.0),
        _request("long", [5] * 9000, ""),
        _request("vocab", [10**6], ""),
        _request("maxtok", prompts[0], "", max_tokens=100_000),
    ]
    for req in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(dec, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req.request_id
        assert e.value.details()
    toks, _ = await _generate(dec, _request("after", prompts[0], ""))
    assert len(toks) == MAX_TOKENS


async def test_unreachable_prefill_worker_is_an_error_not_a_hang(cluster, prompts) -> None:
    procs, ports = cluster
    req = _request("nowhere", prompts[0], f"127.0.0.1:{_free_port()}")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(_generate(procs["shm"].address, req), 40)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    # Nothing says the writer never started (a refused connection and one reset mid-call
    # are both UNAVAILABLE): the blocks come back when the KV lease ends.
    lease = PREFILL_DEADLINE_S + 2.0
    assert await _wait_metric(ports["shm"], "pdserve:kv_cache_usage_perc", 0.0, lease + 3) == 0.0


async def test_sigterm_drains_in_flight_streams_then_exits(prompts) -> None:
    worker = start_unscheduled(
        "services.decode", "--role", "colocated", "--port", "0", "--kv-cache-mib", KV_MIB
    )
    try:
        req = _request("drain", prompts[0], "", max_tokens=40)
        async with cluster_auth.channel(worker.address) as ch:
            toks: list[int] = []
            async for ev in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=120):
                toks.extend(ev.token_ids)
                if len(toks) == 3:
                    worker.proc.send_signal(signal.SIGTERM)
        assert len(toks) == 40  # the stream in flight finished
        assert worker.proc.wait(30) == 0
        assert any('"draining"' in line for line in worker.output)
    finally:
        worker.kill()


@pytest.fixture(scope="module")
def conversation(default_tokenizer, make_engine) -> tuple[list[int], list[int], list[int]]:
    """Turn 1's prompt, its greedy answer, and what turn 2 appends after that answer; the
    answers computed by the colocated engine."""
    tok = default_tokenizer
    question = [{"role": "user", "content": "Tell me about Mars."}]
    turn1 = tok.encode(tok.apply_chat_template(question))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answer = make_engine().generate([turn1], params)[0].token_ids
    follow_up = tok.encode("<|im_end|>\n<|im_start|>user\nAnd its moons?<|im_end|>\n")
    follow_up += tok.encode("<|im_start|>assistant\n")
    return turn1, answer, follow_up


@pytest.mark.parametrize("transport", ["shm", "tcp", "mooncake"])
async def test_a_second_turn_moves_only_the_blocks_the_decode_worker_lacks(
    cluster, conversation, make_engine, transport
) -> None:
    """Turn 2's prompt is turn 1's prompt + answer + a new question. The decode worker kept
    turn 1's blocks (prompt and output), reserves them as present, and the prefill worker
    writes only the rest; the tokens are still the colocated engine's."""
    procs, ports = cluster
    dec, pre = procs[transport], procs["prefill"]
    turn1, answer, follow_up = conversation
    toks1, _ = await _generate(
        dec.address, _request(f"turn1-{transport}", turn1, pre.address, max_tokens=24)
    )
    assert toks1 == answer

    turn2 = turn1 + toks1 + follow_up
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = make_engine().generate([turn2], greedy)[0].token_ids

    def read() -> dict[str, float]:
        return {
            "present": _metric(ports[transport], "pdserve:prompt_tokens_cached_total"),
            "decode_computed": _metric(ports[transport], "pdserve:prompt_tokens_computed_total"),
            "bytes": _metric(ports[transport], "pdserve:kv_transfer_bytes_total"),
            "prefill_cached": _metric(ports["prefill"], "pdserve:prompt_tokens_cached_total"),
            "prefill_computed": _metric(ports["prefill"], "pdserve:prompt_tokens_computed_total"),
        }

    before = read()
    toks2, last = await _generate(dec.address, _request(f"turn2-{transport}", turn2, pre.address))
    delta = {k: v - before[k] for k, v in read().items()}
    assert toks2 == expected

    # Turn 1's last token was sampled, never computed: every full block before it is present.
    present = (len(turn1) + len(toks1) - 1) // 16 * 16
    assert delta["present"] == present > len(turn1)  # turn 1's output blocks reused too
    written = -(-len(turn2) // 16) - present // 16
    assert last.kv_transfer_bytes == delta["bytes"] == written * BLOCK_ALL_LAYERS
    new_tokens = len(turn2) - (len(turn1) + len(toks1) - 1)
    assert last.kv_transfer_bytes <= (-(-new_tokens // 16) + 1) * BLOCK_ALL_LAYERS
    assert last.kv_transfer_bytes < -(-len(turn2) // 16) * BLOCK_ALL_LAYERS
    # usage.cached_tokens: what this request did not compute, the prefill worker's own hit
    assert delta["decode_computed"] == 0
    assert last.usage.cached_tokens == delta["prefill_cached"] > 0
    assert delta["prefill_computed"] == len(turn2) - last.usage.cached_tokens
    assert last.usage.prompt_tokens == len(turn2)
    assert await _wait_metric(ports[transport], "pdserve:kv_cache_usage_perc", 0.0) == 0.0


@pytest.fixture
def region(default_checkpoint):
    """A KV region of this test process laid out like the workers' pools (shm)."""
    spec = KVCacheSpec.for_model(
        default_checkpoint.config, num_blocks=4, block_size=16, dtype=torch.float16
    )  # float16: the workers' default KV dtype on the CPU
    transport = get_transport("shm")
    try:
        yield transport.register(KVLayout.from_spec(spec))
    finally:
        transport.close()


def _prefill_request(
    region, present: int, block_ids: tuple[int, ...] = (2, 3)
) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=f"present-{present}-{block_ids}",
        prompt_token_ids=list(range(200, 232)),  # 32 tokens: 2 blocks
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        deadline_ms=30_000,
        kv_destination=worker_pb2.KVDestination(
            region=handle_to_proto(region.handle),
            block_ids=block_ids,
            num_present_tokens=present,
        ),
    )


async def test_prefill_writes_only_the_blocks_after_num_present_tokens(cluster, region) -> None:
    procs, _ = cluster
    async with cluster_auth.channel(procs["prefill"].address) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        # not a block multiple; the whole prompt (the last token is always computed); beyond
        for present in (8, 32, 48):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Prefill(_prefill_request(region, present), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, present
            assert "num_present_tokens is" in (e.value.details() or ""), e.value.details()
            assert kv_fenced(e.value)  # refused before any writer began
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Prefill(_prefill_request(region, 0, (3, 3)), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "names block 3 twice" in (e.value.details() or ""), e.value.details()
        await asyncio.sleep(0.3)  # nothing still in flight lands later either
        assert not region.tensor.any(), "a refused prefill wrote into the destination"
        reply = await stub.Prefill(_prefill_request(region, 16), timeout=60)
    assert reply.kv_transfer_bytes == BLOCK_ALL_LAYERS  # block 3 only
    assert reply.num_computed_tokens + reply.num_cached_tokens == 32
    # [layer, K/V, block, token, head, dim]
    blocks = region.tensor.view(torch.float16).view(30, 2, 4, 16, 3, 64)
    assert blocks[:, :, 3].abs().sum(dim=(2, 3, 4)).gt(0).all()  # every layer's K and V
    assert not blocks[:, :, [0, 1, 2]].any()  # the present block is left as it was


async def test_staged_workers_equal_colocated(prompts, expected) -> None:
    """``--kv-staging``: each worker keeps its pool apart from the host pool its transport
    uses, as a GPU worker must (the prefill stages each computed layer out, on its writer's
    wait; the decode uploads what arrived), here with two CPU pools."""
    procs: list[ServiceProcess] = []
    try:
        prefill = start_unscheduled("services.prefill", "--port", "0", "--kv-cache-mib", KV_MIB,
                                "--kv-staging")  # fmt: skip
        procs.append(prefill)
        for transport in ("shm", "tcp"):
            decode = start_unscheduled("services.decode", "--port", "0", "--kv-cache-mib", KV_MIB,
                                   "--transport", transport, "--kv-staging")  # fmt: skip
            procs.append(decode)
            results = await asyncio.gather(
                *(
                    _generate(decode.address, _request(f"st-{transport}-{i}", ids, prefill.address))
                    for i, ids in enumerate(prompts)
                )
            )
            assert [toks for toks, _ in results] == expected, transport
            assert all(last.kv_transfer_bytes > 0 for _, last in results)
    finally:
        for p in procs:
            p.stop()


async def test_float32_kv_workers_equal_colocated_and_refuse_a_float16_peer(
    cluster, make_engine, prompts
) -> None:
    """``--kv-cache-dtype float32`` (the exact-parity mode) on both workers: the colocated
    float32 engine's tokens, twice the default's KV bytes over the wire. A decode worker at
    the default float16 cannot take a float32 prefill worker's KV: a clear
    FAILED_PRECONDITION naming the dtype, never bytes misread."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in make_engine(kv_cache_dtype="float32").generate(prompts, params)]
    procs: list[ServiceProcess] = []
    try:
        prefill = start_unscheduled("services.prefill", "--port", "0", "--kv-cache-mib", KV_MIB,
                                "--kv-cache-dtype", "float32")  # fmt: skip
        procs.append(prefill)
        decode = start_unscheduled("services.decode", "--port", "0", "--kv-cache-mib", KV_MIB,
                               "--transport", "shm", "--kv-cache-dtype", "float32")  # fmt: skip
        procs.append(decode)
        ready = dict(part.split("=", 1) for part in decode.ready_line.split() if "=" in part)
        assert ready["kv_dtype"] == "float32"
        results = await asyncio.gather(
            *(
                _generate(decode.address, _request(f"f32-{i}", ids, prefill.address))
                for i, ids in enumerate(prompts)
            )
        )
        assert [toks for toks, _ in results] == want
        blocks = sum(-(-len(ids) // 16) for ids in prompts)
        assert sum(last.kv_transfer_bytes for _, last in results) == blocks * BLOCK_ALL_LAYERS * 2

        default_decode = cluster[0]["shm"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(default_decode.address, _request("mixed", prompts[0], prefill.address))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype" in (err.value.details() or "")
    finally:
        for p in procs:
            p.stop()


@contextlib.contextmanager
def _syn_dropping_port() -> Iterator[int]:
    """A port whose SYNs go unanswered: a listener that never accepts, its accept queue
    (backlog 0) full, so the kernel drops new connection requests and a dial hangs until
    its own timeout, as towards a host that filters its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        with pytest.raises(TimeoutError):  # the port really drops SYNs now
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        yield port
    finally:
        for s in fillers:
            s.close()
        listener.close()


async def test_a_decode_kv_port_that_drops_syns_stalls_no_other_request(
    cluster, prompts, region
) -> None:
    """A Prefill whose tcp destination never answers waits out its connect timeout (5 s) on
    a thread: the prefill worker's other requests and its health checks go on meanwhile."""
    procs, _ = cluster
    with _syn_dropping_port() as port:
        unreachable = MemoryRegionHandle.from_dict(
            {**region.handle.to_dict(), "transport": "tcp", "address": f"127.0.0.1:{port}"}
        )
        bad = worker_pb2.PrefillRequest(
            request_id="syn-dropped",
            prompt_token_ids=list(range(200, 232)),
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
            deadline_ms=30_000,
            kv_destination=worker_pb2.KVDestination(
                region=handle_to_proto(unreachable), block_ids=(2, 3)
            ),
        )
        async with cluster_auth.channel(procs["prefill"].address) as ch:
            stuck = asyncio.ensure_future(
                worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(bad, timeout=30)
            )
            await asyncio.sleep(0.3)  # it is dialling now
            health = health_pb2_grpc.HealthStub(ch)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            toks, _ = await _generate(
                procs["shm"].address,
                _request("beside-syn-drop", prompts[0], procs["prefill"].address),
            )
            assert len(toks) == MAX_TOKENS
            assert not stuck.done(), "the other request waited for the stalled dial"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stuck
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot connect" in (e.value.details() or ""), e.value.details()
    assert kv_fenced(e.value)  # no writer began: the blocks are free at once

"""The pdserve.v1 wire API: committed stubs are fresh, documented, and work over real gRPC.

Staleness is checked byte for byte: the committed ``pdserve/v1/*_pb2*`` files must equal what
``scripts/gen_protos.sh`` produces from ``protos/`` with the installed grpcio-tools.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.message import Message

from pdserve.v1 import (
    common_pb2,
    gateway_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
PROTOS = sorted((PROTO_DIR / "pdserve" / "v1").glob("*.proto"))
STUB_DIR = ROOT / "pdserve" / "v1"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
MODULES = [f"pdserve.v1.{p.stem}{suffix}" for p in PROTOS for suffix in ("_pb2", "_pb2_grpc")]
PB2_MODULES = (common_pb2, gateway_pb2, scheduler_pb2, worker_pb2)


def _protoc(*args: str) -> None:
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"protoc failed: {done.stderr}"


def _generated(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for pattern in GENERATED_GLOBS for p in directory.glob(pattern)}


# --- (1) the committed stubs are what the .proto files generate -------------------------


def test_protos_exist() -> None:
    assert [p.name for p in PROTOS] == [
        "common.proto",
        "gateway.proto",
        "scheduler.proto",
        "worker.proto",
    ]


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    out = str(tmp_path)
    _protoc(
        f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *map(str, PROTOS)
    )
    fresh = _generated(tmp_path / "pdserve" / "v1")
    committed = _generated(STUB_DIR)
    assert len(fresh) == 3 * len(PROTOS)
    tools = importlib.metadata.version("grpcio-tools")
    hint = f"run scripts/gen_protos.sh (installed grpcio-tools {tools})"
    assert sorted(committed) == sorted(fresh), f"stub files differ from the protos: {hint}"
    stale = [name for name in sorted(fresh) if fresh[name] != committed[name]]
    assert stale == [], f"stale generated files {stale}: {hint}"


def test_every_proto_element_is_documented(tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    _protoc(f"--descriptor_set_out={out}", "--include_source_info", *map(str, PROTOS))
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert {f.package for f in files} == {"pdserve.v1"}
    undocumented = []
    for f in files:
        docs = {
            tuple(loc.path): (loc.leading_comments + loc.trailing_comments).strip()
            for loc in f.source_code_info.location
        }
        # Source-info paths: 4 = message_type, 2 = field; 5 = enum_type, 2 = value;
        # 6 = service, 2 = method.
        items: list[tuple[tuple[int, ...], str]] = []
        for i, msg in enumerate(f.message_type):
            items.append(((4, i), msg.name))
            items += [((4, i, 2, j), f"{msg.name}.{fd.name}") for j, fd in enumerate(msg.field)]
        for i, enum in enumerate(f.enum_type):
            items.append(((5, i), enum.name))
            items += [((5, i, 2, j), v.name) for j, v in enumerate(enum.value)]
        for i, svc in enumerate(f.service):
            items.append(((6, i), svc.name))
            items += [((6, i, 2, j), f"{svc.name}.{m.name}") for j, m in enumerate(svc.method)]
        undocumented += [f"{f.name}: {name}" for path, name in items if not docs.get(path)]
    assert undocumented == []


def test_api_doc_names_every_service_rpc_message_and_enum() -> None:
    doc = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    names = []
    for module in PB2_MODULES:
        desc = module.DESCRIPTOR
        names += [f"`{m}`" for m in desc.message_types_by_name]
        names += [f"enum `{e}`" for e in desc.enum_types_by_name]
        for svc in desc.services_by_name.values():
            names.append(f"### `{svc.name}`")
            names += [f"`{m.name}(" for m in svc.methods]
    assert [name for name in names if name not in doc] == []


def test_enum_zero_values_are_unspecified() -> None:
    for module in PB2_MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), f"{enum.name}: zero value is {zero}"
            assert all(v.name.startswith(zero.removesuffix("UNSPECIFIED")) for v in enum.values)


# --- (2) every generated module imports ----------------------------------------------------


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__name__ == name


def test_services_and_methods() -> None:
    def shape(module: object, service: str) -> dict[str, tuple[bool, bool]]:
        desc = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
        return {m.name: (m.client_streaming, m.server_streaming) for m in desc.methods}

    unary, server_stream = (False, False), (False, True)
    assert shape(gateway_pb2, "Gateway") == {"Generate": server_stream, "ListModels": unary}
    assert shape(scheduler_pb2, "Scheduler") == {
        "Place": unary,
        "RegisterWorker": unary,
        "Heartbeat": unary,
        "DeregisterWorker": unary,
        "ReportOutcome": unary,
    }
    assert shape(worker_pb2, "PrefillWorker") == {"Prefill": unary}
    assert shape(worker_pb2, "DecodeWorker") == {"Generate": server_stream}


def test_what_nothing_implements_is_gone_or_reserved() -> None:
    desc = worker_pb2.DESCRIPTOR
    assert set(desc.services_by_name) == {"PrefillWorker", "DecodeWorker"}
    assert not {"TransportOffer", "HandshakeRequest", "HandshakeReply"} & set(
        desc.message_types_by_name
    )
    proto = descriptor_pb2.DescriptorProto()
    desc.message_types_by_name["KVDestination"].CopyToProto(proto)
    assert "session_id" in proto.reserved_name
    assert [(r.start, r.end) for r in proto.reserved_range] == [(1, 2)]


# --- (3) the stubs work over a real in-process gRPC server --------------------------------

_DECODE = common_pb2.WorkerInfo(
    worker_id="decode-0",
    role=common_pb2.WORKER_ROLE_DECODE,
    grpc_address="127.0.0.1:7002",
    transports=["shm", "tcp"],
    model="smollm2-135m",
)


class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Places on one decode worker; rejects prompts over 1000 tokens with back-pressure."""

    async def Place(
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        if request.prompt_tokens > 1000:
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        return scheduler_pb2.Placement(
            request_id=request.request_id,
            decode=_DECODE,
            expected_cached_tokens=len(request.prompt_block_hashes) * request.hash_block_size,
        )


class _Decode(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams the prompt back one token per event, then a final event with usage."""

    async def Generate(
        self, request: worker_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeEvent]:
        n = min(request.sampling.max_tokens, len(request.prompt_token_ids))
        for i, tok in enumerate(request.prompt_token_ids[:n]):
            yield worker_pb2.DecodeEvent(token_ids=[tok], logprobs=[-0.5 * i], text=f"<{tok}>")
        yield worker_pb2.DecodeEvent(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=n
            ),
        )


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(_Scheduler(), server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Decode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        await server.stop(grace=None)


async def test_unary_roundtrip(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    hashes = [0, 2**63, 2**64 - 1]
    reply = await stub.Place(
        scheduler_pb2.PlaceRequest(
            request_id="r1", prompt_tokens=40, prompt_block_hashes=hashes, hash_block_size=16
        ),
        timeout=5,
    )
    assert reply.request_id == "r1"
    assert reply.decode == _DECODE
    assert not reply.HasField("prefill")  # no prefill worker: the decode worker prefills
    assert reply.expected_cached_tokens == 48


async def test_unary_rejection_is_a_status(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    call = stub.Place(scheduler_pb2.PlaceRequest(request_id="big", prompt_tokens=5000), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "queue full"
    assert ("retry-after-ms", "250") in tuple(err.value.trailing_metadata() or ())


async def test_server_streaming_roundtrip(channel: grpc.aio.Channel) -> None:
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    request = worker_pb2.DecodeGenerateRequest(
        request_id="r2",
        prompt_token_ids=[11, 22, 33, 44],
        sampling=common_pb2.SamplingParams(max_tokens=3),
    )
    events = [event async for event in stub.Generate(request, timeout=5)]
    assert [list(e.token_ids) for e in events] == [[11], [22], [33], []]
    assert "".join(e.text for e in events) == "<11><22><33>"
    assert [list(e.logprobs) for e in events[:3]] == [[0.0], [-0.5], [-1.0]]
    assert [e.finish_reason for e in events] == [0, 0, 0, common_pb2.FINISH_REASON_LENGTH]
    assert events[-1].usage == common_pb2.Usage(prompt_tokens=4, completion_tokens=3)
    assert not events[0].HasField("usage")


# --- (4) every message survives serialization with representative values ----------------

_LAYOUT = common_pb2.KVLayout(
    num_layers=30,
    num_blocks=4096,
    block_size=16,
    num_kv_heads=3,
    head_dim=64,
    dtype="bfloat16",
    order=common_pb2.KV_ORDER_LAYER_KV_BLOCK,
)
_REGION = common_pb2.MemoryRegionHandle(
    region_id="decode-0/5f1c",
    transport="rdma",
    address="mlx5_0:1/0x7f3a00000000",
    length=30 * 2 * 4096 * 16 * 3 * 64 * 2,
    key="3735928559",
    layout=_LAYOUT,
    transport_params=b"\x00\x01\xff",
)
_SAMPLING = common_pb2.SamplingParams(
    max_tokens=128,
    temperature=0.0,
    top_p=0.9,
    top_k=-1,
    min_p=0.05,
    seed=2**64 - 1,
    stop=["\n\n", "###"],
    stop_token_ids=[2, 49151],
    ignore_eos=True,
    logprobs=True,
    presence_penalty=0.5,
    frequency_penalty=-1.5,
    repetition_penalty=1.25,
    min_tokens=4,
    logit_bias={42: -100.0, 7: 2.5},
    structured=common_pb2.StructuredOutput(
        kind=common_pb2.STRUCTURED_KIND_JSON_SCHEMA, spec='{"type": "object"}'
    ),
    include_stop_str_in_output=True,
    top_logprobs=20,
)
_TOP = common_pb2.TopLogprobs(token_ids=[1917, 2, 49151], logprobs=[-0.125, -2.5, -7.75])
_USAGE = common_pb2.Usage(prompt_tokens=1000, completion_tokens=37, cached_tokens=512)
_TIMING = common_pb2.Timing(
    queue_seconds=0.001,
    prefill_seconds=0.25,
    kv_transfer_seconds=0.004,
    first_token_seconds=0.26,
    total_seconds=1.5,
)
_WORKER = common_pb2.WorkerInfo(
    worker_id="prefill-host1-4242-ab12",
    role=common_pb2.WORKER_ROLE_PREFILL,
    grpc_address="10.0.0.5:7001",
    metrics_address="10.0.0.5:9001",
    transports=["rdma", "tcp"],
    model="smollm2-135m",
    capacity=common_pb2.WorkerCapacity(
        total_kv_blocks=4096,
        block_size=16,
        max_num_seqs=64,
        max_model_len=8192,
        max_num_batched_tokens=8192,
    ),
    host_id="machine-1/boot-2",
    started_unix_ns=1_764_000_000_123_456_789,
    version="0.1.0",
    kv_region_digest="ab" * 32,
    kv_store="kv-store:50090",
)
_HASHES = [0, 1, 2**63 + 5, 2**64 - 1]

SAMPLES: dict[str, Message] = {
    m.DESCRIPTOR.full_name: m
    for m in [
        _SAMPLING,
        _SAMPLING.structured,
        _TOP,
        _USAGE,
        _TIMING,
        common_pb2.ChatMessage(role="user", content="héllo ✓"),
        common_pb2.ChatMessages(
            messages=[
                common_pb2.ChatMessage(role="system", content="Be brief."),
                common_pb2.ChatMessage(role="user", content="Hi"),
            ]
        ),
        common_pb2.TokenIds(ids=[1, 2, 49151]),
        _LAYOUT,
        _REGION,
        _WORKER.capacity,
        _WORKER,
        gateway_pb2.GenerateRequest(
            request_id="req-1",
            model="smollm2-135m",
            chat=common_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role="user", content="Hi")]
            ),
            sampling=_SAMPLING,
            return_token_ids=True,
        ),
        gateway_pb2.GenerateEvent(
            request_id="req-1",
            text=" world",
            token_ids=[1917, 2],
            logprobs=[-0.125, -3.5],
            produced_unix_ns=1_790_000_000_123_456_789,
            top_logprobs=[_TOP, common_pb2.TopLogprobs(token_ids=[2], logprobs=[-3.5])],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            stop_string="###",
            usage=_USAGE,
            timing=_TIMING,
        ),
        gateway_pb2.ListModelsRequest(),
        gateway_pb2.ListModelsReply(
            models=[
                gateway_pb2.ModelCard(
                    id="smollm2-135m", max_model_len=8192, owned_by="pdserve", created_unix_s=1
                )
            ]
        ),
        gateway_pb2.ModelCard(id="m", max_model_len=2048, owned_by="x", created_unix_s=1_764_000),
        scheduler_pb2.PlaceRequest(
            request_id="req-1",
            model="smollm2-135m",
            attempt=1,
            exclude_worker_ids=["prefill-dead"],
            prompt_tokens=1000,
            max_tokens=128,
            prompt_block_hashes=_HASHES,
            hash_block_size=16,
        ),
        scheduler_pb2.Placement(
            request_id="req-1",
            prefill=_WORKER,
            decode=_DECODE,
            expected_cached_tokens=512,
            placement_token="v1.e30.c2ln",
            local_prefill_max_tokens=32,
            fleet_target_batch=24,
        ),
        scheduler_pb2.RegisterWorkerRequest(worker=_WORKER),
        scheduler_pb2.RegisterWorkerReply(
            heartbeat_interval_ms=1000, lease_ttl_ms=5000, placement_verify_key=b"k" * 32
        ),
        scheduler_pb2.LoadSnapshot(
            running_requests=12,
            waiting_requests=3,
            free_kv_blocks=1000,
            total_kv_blocks=4096,
            queued_prompt_tokens=2**40,
            target_batch=9,
        ),
        scheduler_pb2.HeartbeatRequest(
            worker_id="prefill-host1-4242-ab12",
            state=scheduler_pb2.WORKER_STATE_DRAINING,
            sequence=2**63,
            load=scheduler_pb2.LoadSnapshot(running_requests=1, total_kv_blocks=4096),
            cached_block_hashes_added=_HASHES,
            cached_block_hashes_removed=[7],
            stored_block_hashes=[2**64 - 1, 5],
            store_missing_block_hashes=[6],
            cache_snapshot=False,
        ),
        scheduler_pb2.HeartbeatReply(
            resync_cache=True, heartbeat_interval_ms=2000, placement_verify_key=b"k" * 32
        ),
        scheduler_pb2.DeregisterWorkerRequest(worker_id="decode-0"),
        scheduler_pb2.DeregisterWorkerReply(),
        scheduler_pb2.Outcome(
            request_id="req-1",
            attempt=1,
            prefill_worker_id="prefill-0",
            decode_worker_id="decode-0",
            finish_reason=common_pb2.FINISH_REASON_ERROR,
            error_code=grpc.StatusCode.UNAVAILABLE.value[0],
            error_message="decode worker lost",
            usage=_USAGE,
            arrival_unix_ns=1_764_000_000_000_000_000,
            first_token_unix_ns=1_764_000_000_260_000_000,
            finish_unix_ns=1_764_000_001_500_000_000,
            kv_transfer_bytes=30 * 2 * 1000 * 3 * 64 * 2,
            kv_transfer_seconds=0.004,
        ),
        scheduler_pb2.ReportOutcomeReply(),
        worker_pb2.KVDestination(region=_REGION, block_ids=[7, 8, 100], num_present_tokens=16),
        worker_pb2.PrefillRequest(
            request_id="req-1",
            prompt_token_ids=[1, 2, 3, 49151],
            sampling=_SAMPLING,
            deadline_ms=2000,
            decode_worker_id="decode-0",
            placement_token="v2.e30.c2ln",
            attempt=1,
            kv_destination=worker_pb2.KVDestination(
                region=_REGION, block_ids=[7], num_present_tokens=0
            ),
            resume_token_ids=[5, 6],
        ),
        worker_pb2.PrefillReply(
            request_id="req-1",
            first_token_id=42,
            first_token_logprob=-0.25,
            first_token_top_logprobs=_TOP,
            num_cached_tokens=512,
            num_computed_tokens=488,
            kv_transfer_bytes=2**33,
            queue_seconds=0.001,
            compute_seconds=0.2,
            transfer_seconds=0.19,
            transfer_tail_seconds=0.003,
        ),
        worker_pb2.DecodeGenerateRequest(
            request_id="req-1",
            prompt_token_ids=[1, 2, 3],
            sampling=_SAMPLING,
            prefill_address="10.0.0.5:7001",
            prefill_worker_id="prefill-0",
            placement_token="v2.e30.c2ln",
            attempt=1,
            local_prefill_max_tokens=32,
            resume_token_ids=[9, 10],
        ),
        worker_pb2.DecodeEvent(
            token_ids=[5],
            logprobs=[-1.0],
            text="!",
            produced_unix_ns=1_790_000_000_987_654_321,
            top_logprobs=[_TOP],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            stop_token_id=49151,
            usage=_USAGE,
            timing=_TIMING,
            prefill_worker_id="prefill-0",
            kv_transfer_bytes=123_456_789,
        ),
    ]
}


def test_every_message_has_a_sample() -> None:
    names = {
        desc.full_name
        for module in PB2_MODULES
        for desc in module.DESCRIPTOR.message_types_by_name.values()
    }
    assert names == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_message_roundtrip(name: str) -> None:
    msg = SAMPLES[name]
    data = msg.SerializeToString(deterministic=True)
    back = type(msg).FromString(data)
    assert back == msg
    assert back.SerializeToString(deterministic=True) == data
    # Every singular field set to a non-default value, so a field that silently fails to
    # serialize (or a sample that forgets it) is caught. Oneofs hold one member each.
    members_of_set_oneofs = {
        fd.name
        for oneof in msg.DESCRIPTOR.oneofs
        if back.WhichOneof(oneof.name) is not None
        for fd in oneof.fields
    }
    unset = [
        fd.name
        for fd in msg.DESCRIPTOR.fields
        if fd.name not in members_of_set_oneofs and not _is_set(back, fd.name)
    ]
    allowed_unset = _ALLOWED_UNSET.get(name, set())
    assert set(unset) <= allowed_unset, f"{name}: sample leaves {unset} unset"


# Fields a sample leaves at their zero value on purpose: the contract forbids setting them
# together with the fields the sample does set.
_ALLOWED_UNSET: dict[str, set[str]] = {
    "pdserve.v1.HeartbeatRequest": {"cache_snapshot"},  # a delta, not a snapshot
    "pdserve.v1.GenerateEvent": {"error_message"},  # only with FINISH_REASON_ERROR
    "pdserve.v1.DecodeEvent": {"error_message"},
}


def _is_set(msg: Message, field: str) -> bool:
    desc = msg.DESCRIPTOR.fields_by_name[field]
    if desc.is_repeated:
        return len(getattr(msg, field)) > 0
    if desc.has_presence:
        return msg.HasField(field)
    return getattr(msg, field) != desc.default_value


def test_optional_sampling_fields_keep_presence() -> None:
    # temperature = 0 (greedy) must stay distinguishable from "unset" (default 1.0).
    greedy = common_pb2.SamplingParams.FromString(
        common_pb2.SamplingParams(temperature=0.0, seed=0).SerializeToString()
    )
    assert greedy.HasField("temperature") and greedy.temperature == 0.0
    assert greedy.HasField("seed") and greedy.seed == 0
    blank = common_pb2.SamplingParams.FromString(b"")
    for field in ("max_tokens", "temperature", "top_p", "seed"):
        assert not blank.HasField(field)


def test_wire_types_reject_out_of_range_values() -> None:
    with pytest.raises(ValueError):
        common_pb2.TokenIds(ids=[-1])  # uint32 token ids
    with pytest.raises(ValueError):
        scheduler_pb2.PlaceRequest(prompt_block_hashes=[2**64])  # fixed64 block hashes
    with pytest.raises(ValueError):
        gateway_pb2.GenerateRequest(prompt="a", chat=common_pb2.ChatMessages(), bogus=1)


def test_input_oneof_holds_one_member() -> None:
    req = gateway_pb2.GenerateRequest(prompt="hello")
    assert req.WhichOneof("input") == "prompt"
    req.prompt_token_ids.ids.extend([1, 2])
    assert req.WhichOneof("input") == "prompt_token_ids"
    assert not req.HasField("prompt")

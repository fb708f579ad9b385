"""``--device`` and ``--dtype``: how they resolve, what they refuse, and the model's one
upload per step (a host batch checked, then moved whole to the model's device)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.device import resolve_device, resolve_dtype
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import build_forward_batch
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_auto_resolves_to_what_this_machine_has() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert resolve_dtype("float16", torch.device("cpu")) == "float16"


@pytest.mark.parametrize(
    ("device", "message"),
    [("tpu", "device must be one of"), ("mps", "device must be one of"), ("", "device must")],
)
def test_unknown_devices_are_refused(device: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        resolve_device(device)


@no_cuda
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    for device in ("cuda", "cuda:1"):
        with pytest.raises(InvalidRequestError, match="torch sees no CUDA device"):
            EngineConfig(device=device).resolved()


def test_a_resolved_config_names_the_concrete_device_and_dtype() -> None:
    config = EngineConfig(device="cpu").resolved()
    assert (config.device, config.dtype, config.uses_triton) == ("cpu", "float32", False)
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved().dtype == "bfloat16"
    assert EngineConfig(device="cpu", triton_kernels=True).uses_triton
    if not torch.cuda.is_available():
        assert EngineConfig().resolved().device == "cpu"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="float64")
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        EngineConfig(device="gpu0")


def _scheduled(make_engine: Callable[..., LLMEngine]) -> tuple[LLMEngine, list[ScheduledSeq]]:
    """A prefill of 20 tokens beside a sequence decoding its 41st."""
    engine = make_engine(device="cpu", cpu_kernels=False)
    params = SamplingParams(max_tokens=4)
    prefill = Sequence("p", list(range(100, 120)), params, 0.0)
    prefill.block_table = engine.blocks.allocate(2)
    decode = Sequence("d", list(range(200, 240)), params, 0.0)
    decode.output_ids = [7]
    decode.num_computed = 40
    decode.block_table = engine.blocks.allocate(3)
    return engine, [ScheduledSeq(prefill, 20), ScheduledSeq(decode, 1)]


def test_a_batch_moves_to_a_device_whole(make_engine: Callable[..., LLMEngine]) -> None:
    _, items = _scheduled(make_engine)
    batch = build_forward_batch(items, 16)
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    tensors = [moved.input_ids, moved.positions, moved.slot_blocks, moved.slot_offsets,
               moved.logits_indices, *(s.block_table for s in moved.prefills)]  # fmt: skip
    assert moved.decode is not None
    tensors += [moved.decode.block_tables, moved.decode.context_lens]
    assert {t.device.type for t in tensors} == {"meta"}
    assert moved.decode.max_context_len == 41 and moved.prefills[0].length == 20


@pytest.mark.parametrize(
    "corrupt",
    ["position", "slot", "decode table", "context", "prefill table"],
)
def test_the_host_batch_is_checked_before_any_kernel_runs(
    make_engine: Callable[..., LLMEngine], corrupt: str
) -> None:
    """On a GPU an index out of range corrupts memory or kills the process; the model
    checks the host batch once per step and says which part is wrong."""
    engine, items = _scheduled(make_engine)
    batch = build_forward_batch(items, 16)
    assert batch.decode is not None
    num_blocks = engine.kv_spec.num_blocks
    if corrupt == "position":
        batch.positions[0] = engine.model.rope.cos.shape[0]
    elif corrupt == "slot":
        batch.slot_blocks[3] = num_blocks
    elif corrupt == "decode table":
        batch.decode.block_tables[0, 1] = -1
    elif corrupt == "context":
        batch.decode.context_lens[0] = 3 * 16 + 1
    else:
        batch.prefills[0].block_table[1] = num_blocks + 5
    with pytest.raises(ValueError, match="out of range"):
        engine.model.forward(batch, engine.kv)

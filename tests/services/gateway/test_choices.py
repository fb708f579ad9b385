"""``n`` choices: each choice a seeded request of its own, the others started once choice 0's
prompt is computed (so they reuse its KV blocks), one slot each, and nothing left running
when the client goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from engine.async_engine import AsyncEngine
from engine.checkpoint import Checkpoint
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from services.gateway.admission import Admission, AdmissionLimits
from services.gateway.backend import GenerateChunk, GenerateInput
from services.gateway.choices import StreamEndedEarly, choice_inputs, merged
from services.gateway.engine_backend import EngineBackend

pytestmark = pytest.mark.asyncio


def _input(seed: int | None) -> GenerateInput:
    return GenerateInput("req", (1, 2, 3), SamplingParams(max_tokens=4, seed=seed), "m")


async def test_choice_i_is_the_request_with_seed_plus_i() -> None:
    assert choice_inputs(_input(5), 1) == [_input(5)]
    three = choice_inputs(_input(2**64 - 2), 3)
    assert [c.request_id for c in three] == ["req-0", "req-1", "req-2"]
    assert [c.params.seed for c in three] == [2**64 - 2, 2**64 - 1, 0]  # wraps, stays valid
    assert [c.params.seed for c in choice_inputs(_input(None), 2)] == [None, None]


def _chunk(text: str, finish: str | None = None) -> GenerateChunk:
    return GenerateChunk(text, (), (), finish, 3, 1)


class _Fake:
    """A backend stream whose progress the test drives, recording when it starts and ends."""

    def __init__(self, log: list[str], name: str, gate: asyncio.Event) -> None:
        self.log, self.name, self.gate = log, name, gate

    async def stream(self) -> AsyncIterator[GenerateChunk]:
        self.log.append(f"start {self.name}")
        try:
            yield _chunk(self.name)
            await self.gate.wait()
            yield _chunk("", "stop")
        finally:
            self.log.append(f"end {self.name}")


async def test_the_others_start_after_choice_0s_first_chunk_and_all_close_together() -> None:
    log: list[str] = []
    gate = asyncio.Event()
    fakes = [_Fake(log, str(i), gate) for i in range(3)]
    got: list[tuple[int, str]] = []
    async with aclosing(merged([f.stream for f in fakes])) as it:
        async for index, chunk in it:
            got.append((index, chunk.text_delta))
            if len(got) == 1:
                assert log == ["start 0"]  # nobody else yet: the prompt is computing
            if len(got) == 3:
                break  # the client leaves mid-stream
    assert got[0] == (0, "0") and sorted(got) == [(0, "0"), (1, "1"), (2, "2")]
    assert sorted(e for e in log if e.startswith("end")) == ["end 0", "end 1", "end 2"]


async def test_an_error_in_one_choice_ends_the_request() -> None:
    async def good() -> AsyncIterator[GenerateChunk]:
        yield _chunk("a")
        await asyncio.sleep(30)
        yield _chunk("", "stop")

    async def bad() -> AsyncIterator[GenerateChunk]:
        raise RuntimeError("worker fell over")
        yield _chunk("never")

    with pytest.raises(RuntimeError, match="fell over"):
        async with asyncio.timeout(5):
            async for _ in merged([good, bad]):
                pass


@pytest.mark.parametrize("n", [1, 2])
async def test_a_stream_that_ends_without_its_last_chunk_is_an_error(n: int) -> None:
    async def cut_short() -> AsyncIterator[GenerateChunk]:
        yield _chunk("a")

    with pytest.raises(StreamEndedEarly, match="without a finish reason"):
        async with asyncio.timeout(5):
            async for _ in merged([cut_short] * n):
                pass


async def test_a_request_of_n_holds_n_slots_and_counts_one_rate_token() -> None:
    adm = Admission(AdmissionLimits(4, max_queued=4, rate_per_key=0.001, burst=1))
    async with adm.slot("k", 3):
        assert adm.in_flight == 3
        async with adm.slot("other", 1):
            assert adm.in_flight == 4
    assert adm.in_flight == 0


async def test_choices_1_to_n_reuse_choice_0s_prompt_blocks(
    quantized_checkpoint: Checkpoint, default_tokenizer: Tokenizer
) -> None:
    """With the prefix cache on, choices 1..n find every full block of the prompt computed
    by choice 0, and each choice's tokens equal its seeded single request's. (Batch-invariant
    mode: a choice's logits do not depend on what shares its steps, so no near-tie can
    flip a token between the batch of four and the request alone.)"""
    cfg = EngineConfig(
        weights="quantized", max_model_len=512, num_kv_blocks=128, prefix_caching=True,
        batch_invariant=True,
    )  # fmt: skip
    engine = LLMEngine(cfg, checkpoint=quantized_checkpoint, tokenizer=default_tokenizer)
    backend = EngineBackend(AsyncEngine(engine))
    backend.start()
    try:
        block = engine.config.block_size
        prompt = tuple(range(1000, 1000 + 5 * block + 3))  # 5 full blocks and a partial one
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        inp = GenerateInput("n4", prompt, params, "m")
        last: dict[int, GenerateChunk] = {}
        tokens: dict[int, list[int]] = {i: [] for i in range(4)}
        streams = [lambda c=c: backend.generate(c) for c in choice_inputs(inp, 4)]
        async for i, chunk in merged(streams):
            tokens[i].extend(chunk.token_ids)
            last[i] = chunk
        assert last[0].cached_tokens == 0
        assert [last[i].cached_tokens for i in (1, 2, 3)] == [5 * block] * 3
        for i, c in enumerate(choice_inputs(inp, 4)):
            single = GenerateInput(f"single-{i}", prompt, c.params, "m")
            alone = [t async for ch in backend.generate(single) for t in ch.token_ids]
            assert alone == tokens[i], i
    finally:
        await backend.stop()

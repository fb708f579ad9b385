"""``make_engine`` for the service and stack tests: the engine tests' factory with the
workers' default KV dtype (``EngineConfig``'s auto: float16 on the CPU), so an in-process reference
computes what a served request does. A conftest imports ``served_make_engine``; pytest
registers it under the fixture name ``make_engine``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.checkpoint import Checkpoint
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.tokenizer import Tokenizer
from tests.engine.conftest import engine_factory


@pytest.fixture(scope="session", name="make_engine")
def served_make_engine(
    default_checkpoint: Checkpoint, default_tokenizer: Tokenizer
) -> Callable[..., LLMEngine]:
    served = EngineConfig(device="cpu").resolved().kv_cache_dtype
    return engine_factory(default_checkpoint, default_tokenizer, kv_cache_dtype=served)

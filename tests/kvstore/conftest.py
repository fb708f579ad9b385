"""The real default model and a real ``mooncake_master`` for the KV store's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.master_process import MooncakeMaster
from tests.engine.conftest import default_checkpoint, default_tokenizer, make_engine

__all__ = ["default_checkpoint", "default_tokenizer", "make_engine"]


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster.start()
    yield m
    m.stop()

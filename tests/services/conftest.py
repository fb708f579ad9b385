"""The real default model for service tests: the engine tests' session fixtures, shared."""

from tests.engine.conftest import (  # noqa: F401
    default_checkpoint,
    default_engine,
    default_tokenizer,
    make_engine,
)

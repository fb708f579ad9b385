"""The real default model for service tests: the engine tests' session fixtures, shared;
``make_engine`` builds engines with the workers' default KV dtype."""

from tests.engine.conftest import (  # noqa: F401
    default_checkpoint,
    default_engine,
    default_tokenizer,
    quantized_checkpoint,
)
from tests.served_engine import served_make_engine  # noqa: F401

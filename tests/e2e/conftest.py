"""The whole disaggregated stack, started once per module through ``pdserve up``'s launcher."""

from tests.engine.conftest import (  # noqa: F401
    default_checkpoint,
    default_tokenizer,
    make_engine,
)

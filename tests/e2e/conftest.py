"""The whole disaggregated stack, started once per module through ``pdserve up``'s launcher;
``make_engine`` builds engines with the workers' default KV dtype."""

from tests.engine.conftest import (  # noqa: F401
    default_checkpoint,
    default_tokenizer,
)
from tests.served_engine import served_make_engine  # noqa: F401

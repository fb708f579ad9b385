"""One policy's stack: the ``pdserve up`` command line (pure) and the started stack.

The stack is started in this process the way ``pdserve up`` does it (``services.up.launch``:
every wait has a deadline), and always stopped, its leftover KV segments swept, when the
block ends, whatever happened inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.prefix.config import STORE, PrefixConfig
from bench.prefix.targets import KvLayout


def up_argv(cfg: PrefixConfig, policy: str, *, http_port: int, grpc_port: int,
            log_dir: Path) -> list[str]:  # fmt: skip
    """``pdserve up``'s flags for ``policy``'s stack (a "+store" one runs the KV store)."""
    store = cfg.kv_store_segment_mib if policy.endswith(STORE) else 0
    argv = [
        "--prefill", str(cfg.prefill), "--decode", str(cfg.decode),
        "--routing", policy.removesuffix(STORE), "--kv-store-segment-mib", str(store),
        "--kv-cache-mib", str(cfg.kv_cache_mib), "--http-port", str(http_port),
        "--grpc-port", str(grpc_port), "--log-dir", str(log_dir),
    ]  # fmt: skip
    if cfg.local_prefill_max_tokens is not None:
        argv += ["--local-prefill-max-tokens", str(cfg.local_prefill_max_tokens)]
    return argv


def check_up_flags(argv: list[str]) -> None:
    """``RuntimeError`` unless this checkout's ``pdserve up`` takes ``argv`` (before any
    stack starts: an old checkout without ``--routing`` fails at once)."""
    from services.up import load_up_config

    try:
        load_up_config(argv, {})
    except SystemExit as e:
        raise RuntimeError(f"pdserve up refuses {' '.join(argv)} (see above)") from e


@contextmanager
def running_stack(
    cfg: PrefixConfig, policy: str, log_dir: Path, say: Callable[[str], None]
) -> Iterator[dict[str, str]]:
    """Start ``policy``'s stack, logs in ``log_dir``; yields ``launch``'s endpoints (``http``,
    ``metrics:<worker>`` ...). Stopped on the way out, always."""
    from services.launcher import Stack, free_port
    from services.up import launch, load_up_config

    log_dir.mkdir(parents=True, exist_ok=True)
    argv = up_argv(cfg, policy, http_port=free_port(), grpc_port=free_port(), log_dir=log_dir)
    up = load_up_config(argv, {})
    stack = Stack(log_dir=log_dir)
    say(f"{policy}: starting pdserve up {' '.join(argv)}")
    try:
        yield launch(up, stack)
    finally:
        stack.stop()
        from transfer.shm import sweep_stale_segments  # here: it imports torch

        sweep_stale_segments()
        say(f"{policy}: stack stopped")


def kv_layout() -> KvLayout:
    """The KV block layout of the stacks this module starts (``pdserve up``'s default engine
    settings: model, dtype, block size), from the checkpoint's config. Loads the checkpoint:
    seconds of CPU, so once a run, before any stack starts."""

    from engine.checkpoint import load_checkpoint
    from engine.device import DTYPES
    from engine.engine_config import EngineConfig
    from engine.kv_cache import KVCacheSpec

    engine = EngineConfig().resolved()
    config = load_checkpoint(engine.model).config
    spec = KVCacheSpec.for_model(
        config, num_blocks=1, block_size=engine.block_size, dtype=DTYPES[engine.dtype]
    )
    return KvLayout(
        block_size=engine.block_size, block_bytes=2 * spec.num_layers * spec.block_bytes
    )

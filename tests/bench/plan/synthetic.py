"""Synthetic profiles with simple closed forms, so planner answers can be checked by hand."""

from __future__ import annotations

from bench.plan.profile import Profile


def linear_profile(
    *,
    prefill_s_per_1k: float = 0.5,
    step_base_s: float = 0.020,
    step_per_seq_s: float = 0.001,
    kv_bytes_per_token: int | None = None,
    num_layers: int | None = None,
    transfer_bytes_per_s: float | None = None,
) -> Profile:
    """prefill(P) = P / 1000 · ``prefill_s_per_1k``; step(b, c) = base + b · per_seq (no c)."""
    tokens = (500, 1000, 2000)
    batches = (1, 8, 32)
    contexts = (256, 2048)
    return Profile(
        prefill_tokens=tokens,
        prefill_s=tuple(t / 1000 * prefill_s_per_1k for t in tokens),
        decode_batches=batches,
        decode_contexts=contexts,
        decode_step_s=tuple(
            tuple(step_base_s + b * step_per_seq_s for _ in contexts) for b in batches
        ),
        kv_bytes_per_token=kv_bytes_per_token,
        num_layers=num_layers,
        kv_transfer_bytes_per_s=transfer_bytes_per_s,
        kv_transfer_transport=None if transfer_bytes_per_s is None else "shm",
        model="synthetic",
    )

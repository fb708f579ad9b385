"""``PrefixConfig``: one ``bench.prefix`` run's settings, each default written here once."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("round-robin", "least-loaded", "cache-aware")
WORKLOADS = ("multi-turn", "shared-prefix")
BASELINE = "round-robin"
CANDIDATE = "cache-aware"


@dataclass(frozen=True)
class PrefixConfig:
    """What to run. Policies run in the order given, each on its own stack; both workloads
    run on each. ``mt_*``: the multi-turn workload (``sessions`` x ``turns`` over one system
    prompt); ``sp_*``: shared-prefix (``users`` over ``system_prompts`` system prompts).
    Lengths are words of message content, one token each; ``output_tokens`` is every
    request's ``max_tokens``. ``concurrency``: sessions (users) in flight at once.
    ``local_prefill_max_tokens``: passed to ``pdserve up`` when set (default: its own).
    ``ValueError`` for settings that cannot run."""

    policies: tuple[str, ...] = POLICIES
    workloads: tuple[str, ...] = WORKLOADS
    prefill: int = 2
    decode: int = 2
    kv_cache_mib: int = 256
    local_prefill_max_tokens: int | None = None
    mt_sessions: int = 4
    mt_turns: int = 4
    mt_system_tokens: int = 128
    mt_user_tokens: int = 96
    sp_system_prompts: int = 3
    sp_users: int = 12
    sp_system_tokens: int = 384
    sp_user_tokens: int = 32
    output_tokens: int = 32
    concurrency: int = 4
    timeout_s: float = 300.0
    seed: int = 0
    log_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies must be distinct ones of {list(POLICIES)}, got {bad}")
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads or len(set(self.workloads)) != len(self.workloads):
            raise ValueError(f"workloads must be distinct ones of {list(WORKLOADS)}, got {bad}")
        sizes = {name: getattr(self, name) for name in (
            "prefill", "decode", "kv_cache_mib", "mt_sessions", "mt_turns", "mt_system_tokens",
            "mt_user_tokens", "sp_system_prompts", "sp_users", "sp_system_tokens",
            "sp_user_tokens", "output_tokens", "concurrency",
        )}  # fmt: skip
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.local_prefill_max_tokens is not None and self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")

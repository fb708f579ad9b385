"""``PrefixConfig``: one ``bench.prefix`` run's settings, each default written here once."""

from __future__ import annotations

from dataclasses import dataclass

# A policy is a routing policy, alone or with "+store": the stack also runs the KV store
# (--kv-store-segment-mib of every worker's DRAM); without it, no store.
STORE = "+store"
POLICIES = ("round-robin", "least-loaded", "cache-aware", "cache-aware" + STORE)
WORKLOADS = ("multi-turn", "shared-prefix", "long-document")
BASELINE = "round-robin"
CANDIDATE = "cache-aware"
# long-document's comparison: the store against the same routing without it.
STORE_BASELINE = "cache-aware"
STORE_CANDIDATE = "cache-aware" + STORE


@dataclass(frozen=True)
class PrefixConfig:
    """What to run. Policies run in the order given, each on its own stack; every workload
    runs on each. ``mt_*``: the multi-turn workload (``sessions`` x ``turns`` over one system
    prompt); ``sp_*``: shared-prefix (``users`` over ``system_prompts`` system prompts);
    ``ld_*``: long-document (``sessions`` x ``turns`` questions, each session over its own
    document). ``kv_store_segment_mib``: each worker's share of the store in "+store" stacks.
    Lengths are words of message content, one token each; ``output_tokens`` is every
    request's ``max_tokens``. ``concurrency``: sessions (users) in flight at once.
    ``local_prefill_max_tokens``: passed to ``pdserve up`` when set (default: its own).
    ``ValueError`` for settings that cannot run."""

    policies: tuple[str, ...] = POLICIES[:3]
    workloads: tuple[str, ...] = WORKLOADS[:2]
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
    ld_sessions: int = 24
    ld_turns: int = 4
    ld_min_doc_tokens: int = 2000
    ld_max_doc_tokens: int = 4000
    ld_user_tokens: int = 24
    kv_store_segment_mib: int = 1280
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
            "sp_user_tokens", "output_tokens", "concurrency", "ld_sessions", "ld_turns",
            "ld_min_doc_tokens", "ld_max_doc_tokens", "ld_user_tokens", "kv_store_segment_mib",
        )}  # fmt: skip
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.ld_max_doc_tokens < self.ld_min_doc_tokens:
            raise ValueError("ld_max_doc_tokens must be >= ld_min_doc_tokens")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.local_prefill_max_tokens is not None and self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")

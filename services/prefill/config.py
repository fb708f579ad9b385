"""The prefill worker's configuration: one frozen dataclass, its flags and environment
(``PDSERVE_PREFILL_*``), through ``services.common.settings``."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from services.common import settings
from services.common.cluster_auth import ClusterAuthArgs
from services.common.faults import FaultArgs
from services.common.settings import setting
from services.common.tuning import Tuning
from services.common.worker_args import KVStoreArgs, MooncakeArgs, WorkerArgs

TRANSPORTS = ("shm", "tcp", "mooncake", "cuda_ipc")
ABOUT = (
    "pdserve prefill worker: computes prompts, writes their KV into decode workers' "
    "registered memory layer by layer (shm on one host, tcp or mooncake anywhere) and "
    "answers each "
    "Prefill with the first token."
)


@dataclass(frozen=True)
class PrefillConfig:
    """Everything ``python -m services.prefill`` is told; validated on construction."""

    worker: WorkerArgs = field(default_factory=lambda: WorkerArgs(port=50061))
    transports: tuple[str, ...] = setting(
        ("shm", "tcp"),
        "comma-separated transports this worker can write KV with (shm, tcp, mooncake, cuda_ipc)",
    )
    prefill_token_budget: int = setting(4096, "most prompt tokens computed in one forward pass")
    mooncake: MooncakeArgs = field(default_factory=MooncakeArgs)
    store: KVStoreArgs = field(default_factory=KVStoreArgs)
    cluster: ClusterAuthArgs = field(default_factory=ClusterAuthArgs)
    fault_args: FaultArgs = field(default_factory=FaultArgs)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        if not self.transports:
            raise ValueError("transports must name at least one transport")
        unknown = sorted(set(self.transports) - set(TRANSPORTS))
        if unknown:
            raise ValueError(f"transports: unknown {unknown}; known: {', '.join(TRANSPORTS)}")
        if self.prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {self.prefill_token_budget}")

    def transport_options(self, name: str) -> dict[str, object]:
        """The options this config gives transport ``name``."""
        if name == "mooncake":
            return self.mooncake.options(self.worker.reachable_host)
        return {}


load_config = settings.loader(PrefillConfig, "prefill", "python -m services.prefill", ABOUT)

"""The decode worker's configuration: one frozen dataclass, its flags and environment
(``PDSERVE_DECODE_*``), through ``services.common.settings``."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from services.common import settings
from services.common.cluster_auth import ClusterAuthArgs
from services.common.faults import FaultArgs
from services.common.settings import setting
from services.common.tuning import Tuning
from services.common.worker_args import KVStoreArgs, MooncakeArgs, WorkerArgs

ABOUT = (
    "pdserve decode worker (--role colocated: prefills too): registers its KV pool with a "
    "transport, has prefill workers fill the blocks it reserves for each request, and "
    "streams tokens from its continuous batch."
)
ROLES = ("decode", "colocated")
TRANSPORTS = ("shm", "tcp", "mooncake", "cuda_ipc")


@dataclass(frozen=True)
class DecodeConfig:
    """Everything ``python -m services.decode`` is told; validated on construction."""

    worker: WorkerArgs = field(default_factory=lambda: WorkerArgs(port=50071))
    role: str = setting("decode", "decode, or colocated (prefills locally too)", choices=ROLES)
    transport: str = setting(
        "shm", "how prefill workers write into this worker's KV pool", choices=TRANSPORTS
    )
    kv_port: int = setting(0, "tcp transport: port of the KV receiver (0: any free port)")
    prefill_deadline_s: float = setting(
        30.0, "deadline of a remote prefill, KV transfer included", metavar="SECONDS"
    )
    mooncake: MooncakeArgs = field(default_factory=MooncakeArgs)
    store: KVStoreArgs = field(default_factory=KVStoreArgs)
    cluster: ClusterAuthArgs = field(default_factory=ClusterAuthArgs)
    fault_args: FaultArgs = field(default_factory=FaultArgs)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_port must be a port number, got {self.kv_port}")
        if self.prefill_deadline_s <= 0:
            raise ValueError(f"prefill_deadline_s must be > 0, got {self.prefill_deadline_s}")


load_config = settings.loader(DecodeConfig, "decode", "python -m services.decode", ABOUT)

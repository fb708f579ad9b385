"""An engine worker's link to the KV store: connected in the background, exported as metrics.

``StoreLink.run`` connects (mounts this process's segment) off the event loop and retries
until it succeeds: a worker serves from the start, without the store until it is there
(Mooncake's setup against an absent master takes a minute to give up). Once connected, the
engine's computed full blocks go to the store (``LLMEngine.kv_export``: the engine thread
only queues and holds them; the store's copier releases them) and ``store`` is what the
servicers hand to ``kvstore.prefix.loaded_prefix``.

With ``--kv-store-cpus`` every thread of the store runs on those cores: its own, and the
store client's (Mooncake's transfer threads, which also serve other workers' reads and
writes of this process's segment): they are made by a thread pinned there, and inherit it.

A store on an engine whose pool lives on a GPU would copy blocks across the bus on the
engine thread; untested here (no GPU), so such an engine runs without the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import structlog
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.async_engine import AsyncEngine
from engine.threads import pinned_call
from kvstore.backend import MooncakeBackend, MooncakeOptions, StoreUnavailable
from kvstore.block_format import BlockFormat
from kvstore.store import KVStore, export_to
from services.common.worker_args import KVStoreArgs

log = structlog.get_logger(__name__)

RETRY_S = 5.0


class StoreLink:
    """Owns this worker's ``KVStore``: None until connected (and for good when off)."""

    def __init__(self, args: KVStoreArgs, aengine: AsyncEngine, host: str, role: str) -> None:
        self.args = args
        self.aengine = aengine
        self.host = host
        self.store: KVStore | None = None
        self.role = role
        _COLLECTOR.links.append(self)

    @property
    def enabled(self) -> bool:
        return self.args.enabled and self.aengine.engine.staging is None

    @property
    def master(self) -> str:
        """The store's master this worker registers with the scheduler ("" none)."""
        return (self.args.kv_store or "") if self.enabled else ""

    def confirmed(self) -> list[int]:
        """Blocks confirmed in the store since the last call (for the heartbeat)."""
        return self.store.drain_confirmed() if self.store is not None else []

    def missing(self) -> list[int]:
        """Blocks a lookup found missing from the store since the last call (for the
        heartbeat: the scheduler's index forgets them)."""
        return self.store.drain_missing() if self.store is not None else []

    def loading(self) -> dict[str, Any]:
        """``loaded_prefix``'s keyword arguments."""
        return {
            "timeout_s": self.args.kv_store_load_timeout_s,
            "min_blocks": self.args.kv_store_min_load_blocks,
        }

    async def run(self) -> None:
        """Connect, retrying every ``RETRY_S``; then wire the engine's export to the store."""
        if not self.enabled:
            if self.args.enabled:
                log.warning("kv_store_off", reason="the engine's pool is staged (a GPU's)")
            return
        while self.store is None:
            try:
                self.store = await asyncio.to_thread(self._connect_pinned)
            except StoreUnavailable as e:
                log.warning("kv_store_unavailable", master=self.args.kv_store, error=str(e),
                            retry_s=RETRY_S)  # fmt: skip
                await asyncio.sleep(RETRY_S)
        store = self.store
        await export_to(self.aengine, store)
        log.info("kv_store_connected", master=self.args.kv_store, key_prefix=store.fmt.prefix,
                 segment_mib=self.args.kv_store_segment_mib)  # fmt: skip

    def _connect_pinned(self) -> KVStore:
        """``_connect`` from a thread on ``--kv-store-cpus``, so the store client's threads
        start there; unpinned (logged) when the system refuses those cores."""
        cpus = self.args.kv_store_cpus
        try:
            return pinned_call(cpus, lambda: self._connect(cpus))
        except OSError as e:
            log.warning("kv_store_cpus_refused", cpus=sorted(cpus or ()), error=str(e))
            return self._connect(None)

    def _connect(self, cpus: frozenset[int] | None) -> KVStore:
        from transfer.mooncake import rdma_devices, resolve_protocol

        args, eng = self.args, self.aengine.engine
        protocol = resolve_protocol(args.kv_store_protocol, rdma_devices())
        assert args.kv_store is not None
        options = MooncakeOptions(
            master=args.kv_store,
            host=self.host,
            segment_bytes=args.kv_store_segment_mib << 20,
            protocol=protocol,
            ssd_dir=args.kv_store_ssd_dir or "",
            replicas=args.kv_store_replicas,
        )
        fmt = BlockFormat.for_pool(
            eng.kv_spec, eng.model_digest, batch_invariant=eng.config.batch_invariant
        )
        return KVStore(
            MooncakeBackend(options),
            fmt,
            write_buffer_bytes=args.kv_store_write_buffer_mib << 20,
            cpus=cpus,
        )

    async def close(self) -> None:
        if self.store is not None:
            await export_to(self.aengine, None)
            await asyncio.to_thread(self.store.close)
            self.store = None


_COUNTERS = {
    # metric name suffix: (StoreStats field, help)
    "hit_blocks": ("hit_blocks", "Prefix blocks loaded from the KV store (checked, used)."),
    "loaded_bytes": ("loaded_bytes", "Bytes loaded from the KV store."),
    "stored_blocks": ("stored_blocks", "Full blocks this process put into the KV store."),
    "stored_bytes": ("stored_bytes", "Bytes this process put into the KV store."),
    "dropped_blocks": (
        "dropped_blocks",
        "Full blocks not stored because the write buffer was full (the store is slow or down).",
    ),
    "failed_puts": ("failed_puts", "Blocks the KV store refused or failed to store."),
    "refused_blocks": (
        "refused_blocks",
        "Objects a load refused: their size or header is not the block their key names.",
    ),
    "missing_blocks": ("missing_blocks", "Blocks the store listed but could not read back."),
    "lookups": ("lookups", "Prefix lookups in the KV store."),
    "absent_blocks": (
        "absent_blocks",
        "Lookups whose run ended before the prefix did (the store lacked a block: evicted, "
        "or never stored); each such block is reported to the scheduler's store index.",
    ),
    "copied_blocks": (
        "copied_blocks",
        "Blocks copied out of the pool into the write buffer (on the store's threads).",
    ),
}


class _StoreCollector(Collector):
    """``pdserve:kv_store_*``, read from the links' ``StoreStats`` at scrape time."""

    def __init__(self) -> None:
        self.links: list[StoreLink] = []

    def collect(self) -> Iterator[Any]:
        counters = {
            name: CounterMetricFamily(f"pdserve:kv_store_{name}", text, labels=["role"])
            for name, (_, text) in _COUNTERS.items()
        }
        seconds = CounterMetricFamily(
            "pdserve:kv_store_load_seconds", "Time spent loading prefixes from the KV store.",
            labels=["role"],
        )  # fmt: skip
        offer = CounterMetricFamily(
            "pdserve:kv_store_offer_seconds",
            "Time the engine thread spent handing blocks to the KV store (no copies).",
            labels=["role"],
        )
        loads = CounterMetricFamily(
            "pdserve:kv_store_loads", "Prefix loads from the KV store.", labels=["role"]
        )
        connected = GaugeMetricFamily(
            "pdserve:kv_store_connected", "1 once the KV store is connected.", labels=["role"]
        )
        for link in self.links:
            store = link.store
            connected.add_metric([link.role], 1.0 if store is not None else 0.0)
            stats = store.stats if store is not None else None
            for name, (field, _) in _COUNTERS.items():
                counters[name].add_metric([link.role], getattr(stats, field) if stats else 0)
            seconds.add_metric([link.role], stats.load_seconds_total if stats else 0.0)
            offer.add_metric([link.role], stats.offer_seconds_total if stats else 0.0)
            loads.add_metric([link.role], stats.loads if stats else 0)
        yield from counters.values()
        yield seconds
        yield offer
        yield loads
        yield connected


_COLLECTOR = _StoreCollector()
REGISTRY.register(_COLLECTOR)

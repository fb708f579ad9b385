"""The store's SSD tier (Mooncake's offload, ``--kv-store-ssd-dir``): blocks beyond what the
workers' DRAM segments hold are kept on disk and load byte for byte.

Two stores of 16 MiB of DRAM each (about 86 blocks of this layout in all) take 192 blocks;
the master runs with ``--enable_offload=true``. Mooncake keeps a disk copy of each object
and evicts from DRAM only what has one: a burst the pool cannot take yet is refused, and
the writer tries again while the block waits in its buffer (``PUT_ATTEMPTS``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvstore.backend import MooncakeBackend, MooncakeOptions
from kvstore.block_format import BlockFormat
from kvstore.master_process import MooncakeMaster
from kvstore.store import KVStore

SPEC = KVCacheSpec(num_layers=30, num_blocks=192, block_size=16, num_kv_heads=3, head_dim=64,
                   dtype=torch.float16)  # fmt: skip
SEGMENT = 16 << 20


@pytest.fixture
def ssd_master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster.start(ssd=True)
    yield m
    m.stop()


def _store(master: MooncakeMaster, ssd: Path) -> KVStore:
    ssd.mkdir()
    options = MooncakeOptions(master.address, "127.0.0.1", SEGMENT, ssd_dir=str(ssd), replicas=1)
    return KVStore(MooncakeBackend(options), BlockFormat.for_pool(SPEC, "00000000000000aa"))


@pytest.mark.slow  # ~20 s: it waits for Mooncake's offload to catch up
def test_blocks_beyond_the_dram_pool_load_from_disk(ssd_master, tmp_path: Path) -> None:
    writer, reader = _store(ssd_master, tmp_path / "a"), _store(ssd_master, tmp_path / "b")
    try:
        fmt = writer.fmt
        dram_blocks = 2 * SEGMENT // fmt.object_bytes
        source = KVCache(SPEC)
        source.pool.normal_()
        hashes = list(range(1000, 1000 + SPEC.num_blocks))
        assert len(hashes) > 2 * dram_blocks
        for start in range(0, len(hashes), 16):
            writer.offer(source, hashes[start : start + 16], list(range(start, start + 16)))
            assert writer.flush(30.0)
        there = reader.backend.exists([fmt.key(h) for h in hashes])
        # a put the pool refused 4 times (offload slower than the writer) is dropped, counted
        assert sum(there) + writer.stats.failed_puts >= len(hashes)
        assert sum(there) > 1.5 * dram_blocks
        on_disk = sum(len(files) for d in ("a", "b") for _, _, files in os.walk(tmp_path / d))
        assert on_disk > 0
        # The last quarter was written long after the pool filled: DRAM cannot hold it all.
        tail = [i for i in range(3 * len(hashes) // 4, len(hashes)) if there[i]]
        dest = KVCache(SPEC)
        loaded = [i for i in tail if reader.load(dest, [hashes[i]], [i]) == 1]
        assert len(loaded) >= 0.9 * len(tail) > 0
        for i in loaded:
            assert torch.equal(dest.pool[:, :, i], source.pool[:, :, i])
        assert reader.stats.refused_blocks == 0
    finally:
        writer.close()
        reader.close()

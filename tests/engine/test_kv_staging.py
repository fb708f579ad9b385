"""``KVStaging`` between two CPU pools (the same code a GPU engine runs, with plain copies):
a staged layer moves exactly its blocks, an upload every layer of its blocks."""

from __future__ import annotations

import time

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_staging import KVStaging, ready_now

SPEC = KVCacheSpec(
    num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32
)


def _pools() -> tuple[KVCache, KVCache]:
    device = KVCache(SPEC)
    device.pool.copy_(torch.randn(SPEC.shape))
    return device, KVCache(SPEC, torch.zeros(SPEC.total_bytes, dtype=torch.uint8))


def test_a_staged_layer_moves_exactly_its_blocks() -> None:
    device, host = _pools()
    staging = KVStaging(device, host)
    ready = staging.stage_layer(1, [7, 2, 3, 9])
    assert ready is ready_now and ready(time.monotonic())
    for block in range(SPEC.num_blocks):
        for layer in range(SPEC.num_layers):
            moved = layer == 1 and block in (7, 2, 3, 9)
            got = host.pool[layer, :, block]
            expected = device.pool[layer, :, block] if moved else torch.zeros_like(got)
            assert torch.equal(got, expected), (layer, block)


def test_an_upload_moves_every_layer_of_its_blocks() -> None:
    device, host = _pools()
    host.pool.copy_(torch.randn(SPEC.shape))
    before = device.pool.clone()
    KVStaging(device, host).upload([4, 5, 0])
    for block in range(SPEC.num_blocks):
        source = host.pool if block in (4, 5, 0) else before
        assert torch.equal(device.pool[:, :, block], source[:, :, block]), block


def test_pools_must_match_and_the_host_pool_be_in_host_memory() -> None:
    device, _ = _pools()
    other = KVCacheSpec(3, 11, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="pools differ"):
        KVStaging(device, KVCache(other))
    with pytest.raises(ValueError, match="not in host memory"):
        KVStaging(device, KVCache(SPEC, device="meta"))

"""KVLayout and MemoryRegionHandle: spec round trip, offsets, JSON round trip, validation."""

from __future__ import annotations

import json

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from transfer import KVLayout, MemoryRegionHandle, TransferError, get_transport, known_transports

LAYOUT = KVLayout(
    num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16"
)


def _handle(**changes: object) -> MemoryRegionHandle:
    fields = {
        "transport": "tcp",
        "address": "10.0.0.7:5555",
        "length": LAYOUT.total_bytes,
        "key": "ab" * 16,
        "layout": LAYOUT,
        "region_id": "r1",
    }
    fields.update(changes)
    return MemoryRegionHandle(**fields)  # type: ignore[arg-type]


def test_layout_matches_kv_cache_spec() -> None:
    spec = KVCacheSpec(
        num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
    )
    layout = KVLayout.from_spec(spec)
    assert layout == LAYOUT
    assert layout.to_spec() == spec
    assert layout.block_bytes == spec.block_bytes == 4 * 2 * 8 * 2
    assert layout.total_bytes == spec.total_bytes
    for layer, kv, block in [(0, 0, 0), (0, 1, 3), (2, 1, 9), (1, 0, 5)]:
        assert layout.offset(layer, kv, block) == spec.offset(layer, kv, block)
    # The offset names the bytes KVCache really stores there.
    cache = KVCache(spec)
    cache.values(2)[9].fill_(1.5)
    flat = cache.as_bytes()
    start = layout.offset(2, 1, 9)
    assert torch.all(flat[start : start + layout.block_bytes].view(torch.bfloat16) == 1.5)
    assert int(flat.view(torch.bfloat16).count_nonzero()) == layout.block_bytes // 2


def test_handle_json_round_trip_keeps_every_field() -> None:
    handle = _handle()
    text = json.dumps(handle.to_dict())
    assert MemoryRegionHandle.from_dict(json.loads(text)) == handle
    # Extra fields from a newer peer are ignored.
    data = json.loads(text)
    data["qp"] = {"qpn": 17}
    assert MemoryRegionHandle.from_dict(data) == handle


def test_handle_repr_hides_the_key() -> None:
    assert "ab" * 16 not in repr(_handle())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("key"), "missing field(s) key"),
        (lambda d: d.update(length="4096"), "length must be an int"),
        (lambda d: d.update(length=True), "length must be an int"),
        (lambda d: d.update(length=16), "length must be >="),
        (lambda d: d.update(transport=""), "transport must be a non-empty string"),
        (lambda d: d.update(address=None), "address must be a non-empty string"),
        (lambda d: d.update(layout=[1, 2]), "KV layout: expected a mapping"),
        (lambda d: d["layout"].update(dtype="float31"), "dtype must be one of"),
        (lambda d: d["layout"].update(num_blocks=0), "num_blocks must be >= 1"),
        (lambda d: d["layout"].pop("head_dim"), "missing field(s) head_dim"),
    ],
)
def test_handle_from_garbage_names_the_bad_field(mutate: object, message: str) -> None:
    data = _handle().to_dict()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(TransferError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MemoryRegionHandle.from_dict(data)


@pytest.mark.parametrize("garbage", [None, "handle", 3, [("transport", "tcp")]])
def test_handle_from_non_mapping_is_rejected(garbage: object) -> None:
    with pytest.raises(TransferError, match="expected a mapping"):
        MemoryRegionHandle.from_dict(garbage)


def test_registry_names_known_and_planned_transports() -> None:
    assert known_transports() == ("cuda_ipc", "mooncake", "shm", "tcp")
    with pytest.raises(TransferError, match="RDMA runs through the mooncake transport"):
        get_transport("rdma")
    with pytest.raises(
        TransferError, match="unknown transport 'udp'; known: cuda_ipc, mooncake, shm, tcp"
    ):
        get_transport("udp")
    with pytest.raises(TransferError, match="bad options for transport 'tcp'"):
        get_transport("tcp", colour="blue")
    with get_transport("tcp", port=0) as transport:
        assert transport.name == "tcp"

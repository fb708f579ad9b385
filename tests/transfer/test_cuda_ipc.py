"""``cuda_ipc``: the handle's export encoding and the refusals here; on a GPU, a region in
another process written GPU to GPU through it (``-m gpu``)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.transfer.target import (
    DST_LAYOUT,
    LAYERS,
    MOVES,
    SRC_LAYOUT,
    SRC_SEED,
    Target,
    pattern,
    push_requests,
)
from transfer import KVSource, TransferError, get_transport
from transfer.cuda_ipc import decode_export, encode_export, parse_address

EXPORT = (0, b"\x01\x02handle", 4096, 512, b"/torch_ref_123", 8, b"\x00event", True)


def test_an_export_survives_the_handle_key() -> None:
    assert decode_export(encode_export(EXPORT)) == EXPORT
    no_event = (*EXPORT[:6], None, False)
    assert decode_export(encode_export(no_event)) == no_event


@pytest.mark.parametrize(
    "key",
    ["not base64!", "e30=", encode_export(EXPORT[:7]), encode_export((b"x", *EXPORT[1:]))],
    ids=["garbage", "a mapping", "seven fields", "bytes where an int goes"],
)
def test_a_key_that_is_no_export_is_refused(key: str) -> None:
    with pytest.raises(TransferError, match="cuda_ipc"):
        decode_export(key)


def test_addresses_name_a_pid_and_a_device() -> None:
    assert parse_address("1234@0") == (1234, 0)
    for bad in ("1234", "@0", "x@1", "12@cuda"):
        with pytest.raises(TransferError, match="pid@device"):
            parse_address(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda_the_transport_says_so() -> None:
    with pytest.raises(TransferError, match="needs CUDA"):
        get_transport("cuda_ipc")


def test_sources_live_in_host_or_cuda_memory() -> None:
    with pytest.raises(TransferError, match="CPU or CUDA memory"):
        KVSource(torch.empty(SRC_LAYOUT.total_bytes, dtype=torch.uint8, device="meta"), SRC_LAYOUT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: needs CUDA (none here)")
def test_a_region_in_another_process_is_written_gpu_to_gpu() -> None:
    source = KVSource(pattern(SRC_LAYOUT.total_bytes, SRC_SEED).cuda(), SRC_LAYOUT)
    with get_transport("cuda_ipc") as transport, Target("cuda_ipc", DST_LAYOUT) as target:
        assert target.handle.transport == "cuda_ipc"
        writer = transport.connect(target.handle, source)
        results = push_requests(writer)
        assert [r.layers for r in results] == [len(LAYERS)] * len(MOVES)
        assert target.verify(SRC_LAYOUT, MOVES, LAYERS) == 0
        host = KVSource(pattern(SRC_LAYOUT.total_bytes, SRC_SEED), SRC_LAYOUT)
        with pytest.raises(TransferError, match="from a GPU pool"):
            get_transport("cuda_ipc").connect(target.handle, host)
        target.kill()
        job = writer.begin("late", [0], [1], deadline=time.monotonic() + 5)
        with pytest.raises(TransferError, match="gone"):
            job.finish().result(10)

"""The mooncake transport: Mooncake's Transfer Engine writes into a pool registered by a
target process (protocol tcp here: no RDMA device on these machines)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.transfer.target import (
    DST_LAYOUT,
    LAYERS,
    MOVES,
    SRC_LAYOUT,
    Target,
    assert_pushed,
    push_requests,
    source,
)
from transfer import KVLayout, MemoryRegionHandle, TransferError, TransferTimeout, get_transport
from transfer.mooncake import (
    MooncakeTransport,
    parse_address,
    rdma_devices,
    resolve_protocol,
)

pytestmark = pytest.mark.timeout(60)


def test_writes_land_exactly_in_a_target_process() -> None:
    with MooncakeTransport() as transport, Target("mooncake", DST_LAYOUT) as target:
        assert transport.protocol == "tcp"  # no RDMA device here
        src = source()
        writer = transport.connect(target.handle, src)
        assert transport.connect(target.handle, src) is writer  # cached per region and source
        assert_pushed(writer, target, push_requests(writer))

        target.kill()  # nobody listens any more: the next job fails, and fast
        started = time.monotonic()
        with pytest.raises(TransferError):
            push_requests(writer, timeout=20.0)
        assert time.monotonic() - started < 10.0


def test_a_target_that_stops_answering_times_the_job_out_not_quiet() -> None:
    with MooncakeTransport() as transport, Target("mooncake", DST_LAYOUT) as target:
        writer = transport.connect(target.handle, source())
        push_requests(writer, moves=MOVES[:1])  # the path is open and warm
        target.pause()  # SIGSTOP: writes submitted now never complete
        try:
            started = time.monotonic()
            job = writer.begin("stuck", [0, 1, 2], [5, 6, 7], deadline=started + 1.0)
            for layer in LAYERS:
                job.write_layer(layer)
            job.finish()
            with pytest.raises(TransferTimeout):
                job.outcome.result(10.0)
            # The deadline plus the drain: its writes never reached a terminal status.
            assert time.monotonic() - started < 1.0 + 2.0 + 1.5
            assert not job.quiet
        finally:
            target.resume()


def test_an_abort_before_any_write_is_quiet_and_not_a_failure() -> None:
    with MooncakeTransport() as transport, Target("mooncake", DST_LAYOUT) as target:
        writer = transport.connect(target.handle, source())
        job = writer.begin("early", [0, 1], [5, 6], deadline=time.monotonic() + 10)
        job.abort("cancelled")
        with pytest.raises(TransferError, match="cancelled"):
            job.outcome.result(5.0)
        assert job.quiet
        assert writer.stats().failures == 0


def test_an_abort_after_writes_drains_them_and_is_quiet() -> None:
    with MooncakeTransport() as transport, Target("mooncake", DST_LAYOUT) as target:
        writer = transport.connect(target.handle, source())
        job = writer.begin("mid", [0, 1, 2], [5, 6, 7], deadline=time.monotonic() + 10)
        job.write_layer(0)
        time.sleep(0.05)  # its layer 0 writes are submitted, some maybe still in flight
        job.abort("cancelled")
        with pytest.raises(TransferError, match="cancelled"):
            job.outcome.result(5.0)
        # Every write it submitted completed (the target acknowledges each one after
        # writing it), so nothing of it can land later.
        assert job.quiet


def test_a_handle_outside_the_registered_pool_is_refused_by_the_target() -> None:
    with MooncakeTransport() as transport, Target("mooncake", DST_LAYOUT) as target:
        segment, base = parse_address(target.handle.address)
        # A handle that claims the pool starts past its end: every write falls outside
        # what the target registered, and the target refuses it.
        shifted = MemoryRegionHandle.from_dict(
            {**target.handle.to_dict(), "address": f"{segment}@{base + (1 << 30):#x}"}
        )
        writer = transport.connect(shifted, source())
        with pytest.raises(TransferError, match="failed"):
            push_requests(writer, moves=MOVES[:1])
        assert target.verify(SRC_LAYOUT, [], LAYERS) == 0  # nothing landed anywhere


def test_an_unreachable_segment_fails_connect_within_its_timeout() -> None:
    with MooncakeTransport(connect_timeout=1.0) as transport:
        handle = MemoryRegionHandle(
            transport="mooncake",
            address="127.0.0.1:1@0x10000",  # port 1: nobody listens
            length=DST_LAYOUT.total_bytes,
            key="k",
            layout=DST_LAYOUT,
            region_id="r",
        )
        started = time.monotonic()
        with pytest.raises(TransferError, match="cannot reach mooncake segment"):
            transport.connect(handle, source())
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    "address", ["127.0.0.1:5000", "127.0.0.1@0x10", "host:0@0x10", "h:1@zz", ":1@0x10"]
)
def test_malformed_addresses_are_refused(address: str) -> None:
    with pytest.raises(TransferError, match="not <host:port>@<base hex>"):
        parse_address(address)


def test_protocol_auto_picks_rdma_only_where_a_device_is() -> None:
    assert resolve_protocol("auto", []) == "tcp"
    assert resolve_protocol("auto", ["mlx5_0"]) == "rdma"
    assert resolve_protocol("tcp", ["mlx5_0"]) == "tcp"
    with pytest.raises(TransferError, match="no RDMA device"):
        resolve_protocol("rdma", [])
    with pytest.raises(TransferError, match="one of auto, tcp, rdma"):
        resolve_protocol("udp", [])
    assert rdma_devices() == []  # these machines have none
    with pytest.raises(TransferError, match="no RDMA device"):
        get_transport("mooncake", protocol="rdma")


def test_a_region_is_a_registered_pool_the_engine_unregisters_on_close() -> None:
    layout = KVLayout(
        num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16"
    )
    with MooncakeTransport() as transport:
        region = transport.register(layout)
        segment, base = parse_address(region.handle.address)
        assert segment == transport.segment and base == region.tensor.data_ptr()
        assert region.tensor.numel() == layout.total_bytes
        assert region.tensor.dtype == torch.uint8
        region.close()
        assert region.closed
        region.close()  # idempotent


def test_a_missing_transfer_engine_is_an_error_naming_the_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if not installed
    with pytest.raises(TransferError, match="mooncake-transfer-engine-non-cuda") as e:
        MooncakeTransport(protocol="tcp")
    assert "libibverbs1" in str(e.value)

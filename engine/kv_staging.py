"""KV between an engine's device pool and a host pool of the same shape, layer by layer.

The transports move KV between host-memory pools (a shared-memory segment, a TCP
receiver's buffer, a prefill worker's source pool). An engine whose pool is in GPU memory
keeps a host pool beside it, with the same spec and so the same byte offsets, and this
module moves blocks between the two:

* prefill side, ``stage_layer``: called on the engine thread as soon as the forward pass
  has enqueued a layer's KV store, it enqueues that layer's blocks device -> host on a
  side stream that first waits for an event recorded on the compute stream (so the copy
  starts when the layer's KV is written, while later layers compute), and returns a
  ``LayerReady``: the transfer writer calls it before reading those host bytes;
* decode side, ``upload``: once a request's KV has landed in the host pool, its blocks go
  host -> device on the compute stream, ahead of the first decode step that reads them.

Copies go run by run of consecutive block ids, keys and values apart: each is one
contiguous range in both pools. On the CPU the same code runs with plain copies (a
``KVStaging`` between two CPU pools is how the tests run this path), and ``LayerReady``
is true at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from engine.block_manager import contiguous_runs
from engine.kv_cache import KVCache

LayerReady = Callable[[float], bool]
"""``ready(deadline)``: wait until a staged layer's bytes are in host memory; False if
``deadline`` (``time.monotonic()`` seconds) passed first."""

_POLL_S = 50e-6


def ready_now(deadline: float) -> bool:
    """The ``LayerReady`` of bytes already in host memory."""
    return True


def after_enqueued(device: torch.device) -> LayerReady:
    """Ready once what ``device``'s current stream has enqueued so far has run (at once off
    CUDA, where nothing runs asynchronously)."""
    if device.type != "cuda":
        return ready_now
    done = torch.cuda.Event()
    done.record()
    return lambda deadline: wait_event(done, deadline)


class KVStaging:
    """Moves blocks between ``device_kv`` and ``host_kv`` (equal specs). Engine thread only."""

    def __init__(self, device_kv: KVCache, host_kv: KVCache) -> None:
        if device_kv.spec != host_kv.spec:
            raise ValueError(f"pools differ: {device_kv.spec} and {host_kv.spec}")
        if host_kv.pool.device.type != "cpu":
            raise ValueError(f"the host pool is on {host_kv.pool.device}, not in host memory")
        self.device_kv = device_kv
        self.host_kv = host_kv
        device = device_kv.pool.device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None

    def stage_layer(self, layer: int, block_ids: Sequence[int]) -> LayerReady:
        """Copy ``layer``'s keys and values of ``block_ids`` to the host pool, after what
        the compute stream has enqueued so far; returns when its bytes may be read."""
        runs = contiguous_runs(block_ids)
        if self._stream is None:
            self._copy(layer, runs, to_host=True)
            return ready_now
        written = torch.cuda.Event()
        written.record()  # on the compute stream: after this layer's KV store
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(written)
            self._copy(layer, runs, to_host=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return lambda deadline: wait_event(copied, deadline)

    def upload(self, block_ids: Sequence[int]) -> None:
        """Copy every layer of ``block_ids`` from the host pool into the device pool, on the
        compute stream (so the next forward pass reads them after they land)."""
        runs = contiguous_runs(block_ids)
        for layer in range(self.device_kv.spec.num_layers):
            self._copy(layer, runs, to_host=False)

    def _copy(self, layer: int, runs: list[tuple[int, int]], *, to_host: bool) -> None:
        dev, host = self.device_kv.pool, self.host_kv.pool
        for start, length in runs:
            for kv in (0, 1):
                d = dev[layer, kv, start : start + length]
                h = host[layer, kv, start : start + length]
                if to_host:
                    h.copy_(d, non_blocking=self._cuda)
                else:
                    d.copy_(h, non_blocking=self._cuda)


def wait_event(event: torch.cuda.Event, deadline: float) -> bool:
    """Poll ``event`` until it completes or ``deadline`` passes (a CUDA event has no
    timed wait); a staged layer takes well under a millisecond to copy."""
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True

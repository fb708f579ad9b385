"""The fence on every transport that writes into a host pool: once a failed job's outcome
says quiet, no byte of it lands any more, even bytes its writer moves late.

The initiator's fault spec freezes each writer right before it moves a job's first bytes
(``stall_ms``: a writer descheduled mid-job). The job is aborted during the freeze, so the
writer wakes with an abort waiting and moves its first bytes late anyway. As soon as the
outcome is in and quiet, the test plays the decode worker that reuses the blocks: it fills
them with another request's bytes. Whatever the late writer still did must have landed
before that.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.transfer.target import DST_LAYOUT, blocks_view, pattern, source
from transfer import TransferError, get_transport
from transfer.faults import FaultSpec

pytestmark = pytest.mark.timeout(60)

STALL_S = 0.5
SRC_IDS, DST_IDS = [0, 1, 2], [5, 6, 7]


@pytest.mark.parametrize("name", ["shm", "tcp", "mooncake"])
def test_no_byte_of_a_failed_job_lands_after_its_quiet_outcome(name: str) -> None:
    opts = {"protocol": "tcp"} if name == "mooncake" else {}
    with get_transport(name, **opts) as target, get_transport(name, **opts) as initiator:
        region = target.register(DST_LAYOUT)
        initiator.inject_faults(FaultSpec(stall_ms=STALL_S * 1000))
        a = source()
        writer = initiator.connect(region.handle, a)
        job = writer.begin("late", SRC_IDS, DST_IDS, deadline=time.monotonic() + 20)
        for layer in range(DST_LAYOUT.num_layers):
            job.write_layer(layer)
        time.sleep(STALL_S / 5)  # the writer is frozen now, about to move the first layers
        job.abort("cancelled: the caller went away")
        with pytest.raises(TransferError, match="cancelled"):
            job.outcome.result(10)
        assert job.quiet, "an abort the transport can confirm"
        blocks = blocks_view(region.tensor, DST_LAYOUT)
        src = blocks_view(a.tensor, a.layout)
        # The frozen writer did write late: the first layer of A's blocks holds A's bytes.
        assert torch.equal(blocks[0, :, DST_IDS], src[0, :, SRC_IDS])
        # The decode worker gives the blocks to request B at once.
        b = pattern(DST_LAYOUT.total_bytes, seed=99)
        b_blocks = blocks_view(b, DST_LAYOUT)
        blocks[:, :, DST_IDS] = b_blocks[:, :, DST_IDS]
        time.sleep(STALL_S)  # long past the freeze: a late byte would have landed by now
        assert torch.equal(blocks[:, :, DST_IDS], b_blocks[:, :, DST_IDS]), (
            "a byte of the failed job landed after its outcome said quiet"
        )

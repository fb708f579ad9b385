"""The prompt's block hashes that go with ``Place``, in the block size the workers run.

Prefix routing matches the gateway's hashes of a prompt against the hashes the workers
publish of the blocks they cache, so both must cut the prompt into blocks of the same size.
That size belongs to the workers (``--block-size``, registered with the scheduler as
``capacity.block_size``), and the scheduler ignores hashes for a worker whose size differs.
The gateway therefore takes it from the scheduler's answers: every ``Placement`` carries its
workers' ``WorkerInfo``, capacity included. Until a gateway's first placement the size is
unknown and a request goes without hashes (placed by load alone: one request may miss a
cache hit after a gateway starts).

Workers of one model with different block sizes cannot all be routed by prefix: a
placement whose workers differ, or a size other than those seen before, is logged
(``block_size_mismatch``, once per size), and the hashes follow the latest placement's
prefill worker (its decode worker for a local prefill).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from engine.block_hash import hash_blocks
from pdserve.v1 import scheduler_pb2

log = structlog.get_logger(__name__)


class PrefixHashes:
    """The cluster's block size as the placements tell it, and prompts hashed in it."""

    def __init__(self, model: str = "") -> None:
        self.model = model
        self.block_size = 0  # unknown until the first placement
        self._seen: set[int] = set()

    def of(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The prompt's full blocks' chained hashes and the block size they were cut with
        (``PlaceRequest.prompt_block_hashes`` and ``hash_block_size``); none while the size
        is unknown."""
        if not self.block_size:
            return [], 0
        return hash_blocks(prompt_token_ids, self.block_size), self.block_size

    def learn(self, placement: scheduler_pb2.Placement) -> None:
        """Take the block size of ``placement``'s workers; log one that breaks prefix
        routing."""
        workers = [placement.decode]
        if placement.HasField("prefill"):
            workers.insert(0, placement.prefill)
        sizes = [w.capacity.block_size for w in workers if w.capacity.block_size]
        if not sizes:
            return
        new = set(sizes) - self._seen
        self._seen.update(sizes)
        if new and len(self._seen) > 1:
            log.warning(
                "block_size_mismatch",
                model=self.model,
                block_sizes=sorted(self._seen),
                placement={w.worker_id: w.capacity.block_size for w in workers},
                detail="workers of one model run different --block-size values: prefix "
                "routing only reaches those whose size the latest placement had",
            )
        self.block_size = sizes[0]

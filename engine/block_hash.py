"""Content hashes of full KV blocks, stable across processes, runs and machines.

A full block is named by a chained hash: ``hash_block(parent, token_ids)`` where ``parent`` is
the hash of the block before it (``ROOT_HASH`` for the first block of a sequence). Two blocks
share a hash only if the whole token prefix up to and including them is the same, which is what
makes a hash safe to use as a prefix-cache key here and as a routing key across workers.

Encoding (version 1; changing any of it changes every hash, so bump the personalisation):

* BLAKE2b with ``digest_size=8`` and ``person=b"pdserve-kvblk-v1"`` (domain separation).
* Message: ``parent`` as 8-byte little-endian unsigned, then the number of tokens as 4-byte
  little-endian unsigned, then each token id as 4-byte little-endian unsigned.
* The 8-byte digest read as a little-endian unsigned integer is the hash, in ``[0, 2**64)``.

Python's built-in ``hash()`` is not used: it is salted per process (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from engine.errors import InvalidRequestError

_PERSON = b"pdserve-kvblk-v1"
_MAX_HASH = 2**64 - 1


def _digest64(message: bytes) -> int:
    digest = hashlib.blake2b(message, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little")


ROOT_HASH: int = _digest64(b"root")
"""Parent hash of a sequence's first block (the hash of the 4-byte message ``b"root"``)."""


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Return the chained content hash of one block.

    ``parent`` is the previous block's hash (or ``ROOT_HASH``), a value in ``[0, 2**64)``;
    ``token_ids`` are the block's tokens, each in ``[0, 2**32)``. Raises
    ``InvalidRequestError`` for values outside those ranges. Pure and deterministic.
    """
    if not 0 <= parent <= _MAX_HASH:
        raise InvalidRequestError(f"parent hash {parent} is not a 64-bit unsigned value")
    n = len(token_ids)
    try:
        message = struct.pack(f"<QI{n}I", parent, n, *token_ids)
    except struct.error as exc:
        raise InvalidRequestError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    return _digest64(message)


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Return the chained hashes of every full block of ``token_ids``, in order.

    A trailing partial block (fewer than ``block_size`` tokens) has no hash. ``parent`` is the
    hash the first block chains from, so a caller can continue a chain it already hashed.
    """
    if block_size <= 0:
        raise InvalidRequestError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes

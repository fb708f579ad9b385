"""Errors the KV data plane raises. Each is a state the caller can act on, never a hang.

``TransferError`` is the base: a broken connection, a dead peer, a bad handle, a write
outside the region. ``TransferTimeout`` means a deadline passed before the bytes were
confirmed in the target's memory (retry elsewhere or recompute). ``IncompatibleLayoutError``
means the two KV pools cannot exchange blocks byte for byte (different model, block size or
dtype): no transfer between them can ever work.
"""


class TransferError(Exception):
    """A KV transfer, registration or handle is unusable; the message says why."""


class TransferTimeout(TransferError):
    """A deadline passed before the transfer was confirmed complete."""


class IncompatibleLayoutError(TransferError):
    """Source and destination KV layouts differ in something other than their block count."""

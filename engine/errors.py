"""Errors the engine raises. Each names what was wrong so an edge can map it to a status.

Every error derives from ``EngineError``; ``InvalidRequestError`` is the caller's fault
(maps to HTTP 400 / gRPC INVALID_ARGUMENT), ``ModelLoadError`` is a bad checkpoint path or
file (the process cannot serve), ``CapacityError`` means the request can never fit, and
``ResourceExhaustedError`` means it does not fit now (maps to RESOURCE_EXHAUSTED / 429).
"""


class EngineError(Exception):
    """Base class of every error pdserve's engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is invalid (bad prompt, bad sampling parameters)."""


class ModelLoadError(EngineError):
    """The checkpoint cannot be loaded: missing path, unknown format, corrupt file."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but uses an architecture or tensor type we do not run."""


class ResourceExhaustedError(EngineError):
    """No capacity right now (KV blocks, batch slots); the same request may succeed later."""


class CapacityError(EngineError):
    """The request can never be served with this engine's KV capacity or context."""

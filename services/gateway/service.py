"""The state both edges (HTTP and gRPC) share: served models, backend, metrics, draining.

Lifecycle of a request at the edge: authenticate -> parse/validate -> template + tokenize
(``GenerateInput``) -> ``generate`` (backend stream, timed) -> relay chunks to the client.
A client that goes away closes the stream, which cancels the request in the backend.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence

from services.gateway.backend import Backend, GenerateChunk, GenerateInput
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_api import Limits
from services.gateway.served_model import ServedModel


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class GatewayService:
    """One gateway process's shared state. Only the event loop thread touches it."""

    def __init__(
        self,
        backend: Backend,
        models: Sequence[ServedModel],
        *,
        metrics: GatewayMetrics | None = None,
        limits: Limits = Limits(),  # noqa: B008 (frozen, so sharing the default is safe)
        api_keys: Iterable[str] = (),
    ) -> None:
        if not models:
            raise ValueError("a gateway serves at least one model")
        self.backend = backend
        self.models: dict[str, ServedModel] = {m.name: m for m in models}
        self.metrics = metrics or GatewayMetrics(models[0].name)
        self.limits = limits
        self._api_keys = tuple(k.encode() for k in api_keys)
        self.draining = False

    def start_draining(self) -> None:
        """Refuse new generations (UNAVAILABLE / 503) and fail health checks from now on."""
        self.draining = True

    async def ready(self) -> bool:
        return not self.draining and await self.backend.ready()

    def authorized(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value is acceptable (always, without keys)."""
        if not self._api_keys:
            return True
        if not authorization or not authorization.startswith("Bearer "):
            return False
        key = authorization.removeprefix("Bearer ").strip().encode()
        # Compare against every key so timing does not reveal which prefix matched.
        return any([hmac.compare_digest(key, k) for k in self._api_keys])

    def generate(self, inp: GenerateInput, received_at: float) -> AsyncIterator[GenerateChunk]:
        """Run ``inp`` on the backend and stream its chunks, timed from ``received_at``
        (``time.monotonic()``). Closing the returned iterator cancels the request."""
        return self.metrics.track(self.backend.generate(inp), received_at, inp.model)

"""The state both edges (HTTP and gRPC) share: served models, backend, metrics, draining.

Lifecycle of a request at the edge: authenticate -> parse/validate -> size check (a prompt
that cannot fit is refused before any templating) -> admission (``admitted``: rate limit,
slot or queue, whatever the backend) -> template + tokenize off the event loop (``prepare``)
-> ``generate`` (backend stream, timed) -> relay chunks to the client -> slot released.
A client that goes away closes the stream, which cancels the request in the backend.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import ParamSpec, TypeVar

from services.gateway.admission import Admission, AdmissionLimits
from services.gateway.backend import Backend, GenerateChunk, GenerateInput
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_api import Limits
from services.gateway.served_model import ServedModel

P = ParamSpec("P")
T = TypeVar("T")


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
        admission: AdmissionLimits = AdmissionLimits(64, 64),  # noqa: B008 (frozen)
    ) -> None:
        if not models:
            raise ValueError("a gateway serves at least one model")
        self.backend = backend
        self.models: dict[str, ServedModel] = {m.name: m for m in models}
        self.metrics = metrics or GatewayMetrics(models[0].name)
        self.limits = limits
        self._api_keys = tuple(k.encode() for k in api_keys)
        self.admission = Admission(admission, on_refused=self.metrics.count_refusal)
        self.metrics.waiting.set_function(lambda: self.admission.queued)
        self.metrics.concurrency.set_function(lambda: self.admission.limits.max_concurrent)
        self.draining = False

    def start_draining(self) -> None:
        """Refuse new generations (UNAVAILABLE / 503) and fail health checks from now on."""
        self.draining = True
        self.admission.start_draining()

    def rate_key(self, authorization: str | None, peer: str) -> str:
        """Whose rate bucket a request draws from: its API key, or without keys its
        client's address."""
        if self._api_keys and authorization:
            return "key:" + authorization.removeprefix("Bearer ").strip()
        return "peer:" + peer

    def admitted(self, key: str, count: int = 1) -> AbstractAsyncContextManager[None]:
        """Hold ``count`` admission slots (one per choice) for the body
        (``Admission.slot``): every backend, both edges."""
        return self.admission.slot(key, count)

    async def prepare(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` (templating, tokenizing: CPU work that grows with the prompt) on a
        thread, so the event loop keeps relaying other streams' tokens meanwhile."""
        return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))

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

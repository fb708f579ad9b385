"""An in-process gateway over the real model: engine backend, HTTP and gRPC servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.process import GrpcServer
from services.gateway.admission import AdmissionLimits
from services.gateway.engine_backend import EngineBackend
from services.gateway.grpc_server import grpc_server as gateway_grpc_server
from services.gateway.http_server import HttpServer, create_app
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService

MODEL = "smollm2-test"
MAX_MODEL_LEN = 256
MAX_BODY = 64 * 1024


@dataclass
class Gateway:
    engine: LLMEngine
    backend: EngineBackend
    service: GatewayService
    http: HttpServer | None
    grpc: GrpcServer | None

    @property
    def base_url(self) -> str:
        assert self.http is not None
        return f"http://127.0.0.1:{self.http.port}"

    @property
    def grpc_target(self) -> str:
        assert self.grpc is not None
        return f"127.0.0.1:{self.grpc.port}"

    def all_blocks_free(self) -> bool:
        blocks = self.engine.blocks
        return blocks.num_free_blocks == blocks.num_blocks and not self.engine.has_unfinished()

    async def wait_blocks_free(self, timeout: float = 1.0) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if self.idle():
                return True
            await asyncio.sleep(0.01)
        return self.idle()

    def idle(self) -> bool:
        """No KV block held, nothing running in the backend, no admission slot taken."""
        busy = self.backend.num_active or self.service.admission.in_flight
        return self.all_blocks_free() and not busy

    async def reference(self, ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
        """The engine's own output for these prompt ids (through the same engine thread)."""
        toks: list[int] = []
        text = ""
        async for ev in self.backend.engine.generate(f"ref-{id(ids)}", ids, params):
            toks.extend(ev.new_token_ids)
            text += ev.text_delta
        return toks, text


@asynccontextmanager
async def running_gateway(
    make_engine: Callable[..., LLMEngine], *, http: bool = True, grpc: bool = True
) -> AsyncIterator[Gateway]:
    # No prefix caching: each request computes its own prompt, so outputs compare exactly.
    engine = make_engine(max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, prefix_caching=False)
    backend = EngineBackend(AsyncEngine(engine))
    backend.start()
    service = GatewayService(
        backend, [ServedModel.for_engine(MODEL, engine)], admission=AdmissionLimits(16, 16)
    )
    http_server = grpc_server = None
    try:
        if http:
            app = create_app(service, max_body_bytes=MAX_BODY)
            http_server = HttpServer(app, "127.0.0.1", 0, drain_timeout_s=2.0)
            await http_server.start()
        if grpc:
            grpc_server = gateway_grpc_server(service, "127.0.0.1", 0, max_message_bytes=MAX_BODY)
            await grpc_server.start()
        yield Gateway(engine, backend, service, http_server, grpc_server)
    finally:
        if http_server is not None:
            await http_server.stop()
        if grpc_server is not None:
            await grpc_server.stop(0)
        await backend.stop()

"""How pdserve services authenticate each other: one cluster token, optionally (m)TLS.

Every internal gRPC server (scheduler, prefill, decode) refuses a call whose metadata lacks
``x-pdserve-cluster-token: <token>`` with ``UNAUTHENTICATED``; every internal client opens
its channel with ``channel``, which attaches the token to each call and speaks TLS when a
CA is configured. ``grpc.health.v1`` and server reflection stay open (probes and tools
carry no token); Prometheus ``/metrics`` is a separate HTTP port, unauthenticated too.
The gateway's public API is not behind this: it keeps its own API keys.

The token comes from ``--cluster-token-file`` (``PDSERVE_CLUSTER_TOKEN_FILE``) or from
``PDSERVE_CLUSTER_TOKEN`` (environment only: a token on a command line is visible to every
user of the machine); the variables are shared by every service. Without a token a service
refuses to start (exit status 2) unless ``--insecure-cluster`` (``PDSERVE_INSECURE_CLUSTER``)
says to run internal gRPC unauthenticated, and then warns once; an insecure prefill worker
does not check placement tokens either. Placement tokens do not derive from the cluster
token: the scheduler signs them with a key of its own (``services.common.placement_token``).

TLS: ``--cluster-tls-cert``/``--cluster-tls-key`` make the server side TLS (and are the
client certificate for mTLS); ``--cluster-tls-ca`` makes clients verify servers against it
and servers require and verify client certificates (mutual TLS).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from services.common.faults import rpc_fault_interceptors
from services.common.settings import read_secret, setting

log = structlog.get_logger(__name__)

TOKEN_METADATA_KEY = "x-pdserve-cluster-token"
# Methods under these prefixes answer without a token: probes and tools carry none.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class ClusterAuthArgs:
    """The settings every service that speaks internal gRPC shares; ``ValueError`` when
    they contradict each other. Paths are read at start (``load``), not here."""

    cluster_token_file: str | None = setting(
        None,
        "file holding the cluster token internal gRPC calls carry (or the token itself in "
        "PDSERVE_CLUSTER_TOKEN); neither: the service refuses to start (see "
        "--insecure-cluster)",
        env="PDSERVE_CLUSTER_TOKEN_FILE",
        metavar="PATH",
    )
    cluster_token: str | None = setting(
        None, "the cluster token itself", env="PDSERVE_CLUSTER_TOKEN", secret=True
    )
    insecure_cluster: bool = setting(
        False,
        "run internal gRPC without a cluster token: any process that reaches this service's "
        "port may call it, and a prefill worker writes KV wherever it is told (a try-out on "
        "one machine only)",
        env="PDSERVE_INSECURE_CLUSTER",
    )
    cluster_tls_cert: str | None = setting(
        None,
        "PEM certificate of this process's internal gRPC server (and its client certificate "
        "for mutual TLS); with --cluster-tls-key",
        env="PDSERVE_CLUSTER_TLS_CERT",
        metavar="PATH",
    )
    cluster_tls_key: str | None = setting(
        None, "PEM private key of --cluster-tls-cert", env="PDSERVE_CLUSTER_TLS_KEY", metavar="PATH"
    )
    cluster_tls_ca: str | None = setting(
        None,
        "PEM CA bundle: clients verify internal servers against it, servers require client "
        "certificates it signed (mutual TLS)",
        env="PDSERVE_CLUSTER_TLS_CA",
        metavar="PATH",
    )

    def __post_init__(self) -> None:
        if self.cluster_token_file and self.cluster_token:
            raise ValueError(
                "give the cluster token one way: --cluster-token-file or PDSERVE_CLUSTER_TOKEN"
            )
        if self.cluster_token is not None and not self.cluster_token.strip():
            raise ValueError("PDSERVE_CLUSTER_TOKEN is blank")
        if self.insecure_cluster and (self.cluster_token_file or self.cluster_token):
            raise ValueError("--insecure-cluster and a cluster token contradict each other")
        if bool(self.cluster_tls_cert) != bool(self.cluster_tls_key):
            raise ValueError("--cluster-tls-cert and --cluster-tls-key go together")


@dataclass(frozen=True)
class ClusterAuth:
    """What a process knows to authenticate internal calls: the token and TLS material
    (bytes, read once). ``ClusterAuth()`` is the open cluster."""

    token: str | None = field(default=None, repr=False)
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS for an internal server (client certificates required with a CA); None: plain."""
        if self.cert is None or self.key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=bool(self.ca)
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS for an internal client (the server verified against the CA); None: plain."""
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The server interceptors that enforce the token (none without one)."""
        return [] if self.token is None else [TokenCheck(self.token)]


def load(args: ClusterAuthArgs) -> ClusterAuth:
    """Read the files ``args`` names; ``ValueError`` naming the one that cannot be read, or
    saying that there is no token and ``--insecure-cluster`` was not given."""

    def read(path: str | None, what: str) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from None

    token = read_secret(args.cluster_token_file, "cluster token file") or args.cluster_token
    if not token and not args.insecure_cluster:
        raise ValueError(
            "no cluster token: give --cluster-token-file PATH or PDSERVE_CLUSTER_TOKEN (the "
            "same on every service), or --insecure-cluster to run internal gRPC "
            "unauthenticated"
        )
    return ClusterAuth(
        token=token.strip() if token else None,
        cert=read(args.cluster_tls_cert, "TLS certificate"),
        key=read(args.cluster_tls_key, "TLS key"),
        ca=read(args.cluster_tls_ca, "TLS CA bundle"),
    )


_installed = ClusterAuth()


def install(auth: ClusterAuth, service: str) -> None:
    """Make ``auth`` this process's: ``installed()`` and ``channel`` use it. Without a token
    (``--insecure-cluster``), warns once that internal calls are not authenticated."""
    global _installed
    _installed = auth
    if auth.token is None:
        log.warning(
            "cluster_auth_off",
            service=service,
            detail="--insecure-cluster: internal gRPC calls are not authenticated; any process "
            "that reaches this service's port may call it",
        )


def installed() -> ClusterAuth:
    """This process's cluster auth (open until ``install``)."""
    return _installed


def channel(
    address: str,
    auth: ClusterAuth | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
) -> grpc.aio.Channel:
    """A channel to an internal service at ``address``: every call carries the cluster
    token, over TLS when a CA is configured. ``auth``: default ``installed()``;
    ``options``: gRPC channel arguments."""
    auth = installed() if auth is None else auth
    interceptors: list[Any] = []
    if auth.token is not None:
        md = ((TOKEN_METADATA_KEY, auth.token),)
        interceptors = [_UnaryUnary(md), _UnaryStream(md), _StreamUnary(md), _StreamStream(md)]
    interceptors += rpc_fault_interceptors()  # none unless a fault spec asks (tests, chaos)
    creds = auth.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options, interceptors=interceptors)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection whose ``x-pdserve-cluster-token``
    metadata is not the token (``UNAUTHENTICATED``; constant-time comparison)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        given = [v for k, v in details.invocation_metadata or () if k == TOKEN_METADATA_KEY]
        if not given:
            return _refusal(handler, f"{method}: missing {TOKEN_METADATA_KEY} metadata")
        value = given[0].encode() if isinstance(given[0], str) else given[0]
        if not hmac.compare_digest(value, self._token):
            return _refusal(handler, f"{method}: wrong {TOKEN_METADATA_KEY}")
        return handler


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED without running it."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        log.warning("internal_call_refused", reason=message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _with_token(details: grpc.aio.ClientCallDetails, md: tuple[tuple[str, str], ...]) -> Any:
    metadata = grpc.aio.Metadata(*md)
    for k, v in details.metadata or ():
        metadata.add(k, v)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self._md = md

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._md), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self._md = md

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._md), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self._md = md

    async def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(_with_token(details, self._md), it)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self._md = md

    async def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(_with_token(details, self._md), it)

"""Placement tokens: the scheduler's signed word that one prefill worker may write one
attempt of one request's KV into one decode worker's registered region.

The scheduler mints a token at ``Place`` over (request id, attempt, decode worker id,
prefill worker id, the digest of the decode worker's KV region, an expiry); the gateway
hands it to the decode worker, which passes it on in ``PrefillRequest``; the prefill worker
checks it against the request, its own worker id and the destination handle it was given
before it connects a writer.

Tokens are Ed25519 signatures. The private key lives in the scheduler alone (generated at
start, or ``--placement-signing-key-file``); workers learn the public key from the
scheduler's ``RegisterWorker`` and ``Heartbeat`` replies. So a worker, or anyone holding
the cluster token, can check a token but cannot mint one: a caller cannot aim a prefill
worker at memory, or at a worker, the scheduler did not place.

Form: ``v2.<claims>.<signature>``, both parts unpadded base64url; claims are compact JSON
``{"r": request_id, "a": attempt, "w": decode_worker_id, "p": prefill_worker_id,
"d": region_digest, "e": expiry_unix_s}``; the signature covers the ``v2.<claims>`` text.
The claims are readable (ids and a digest, no secret) so a refusal can say what did not
match. Expiry is wall clock: hosts' clocks must agree to within the token's lifetime.

Pure apart from key files: the clock is an argument.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

VERSION = "v2"
DEFAULT_TTL_S = 600.0
# Public keys a worker keeps: the scheduler's current one and those of the schedulers just
# before it (tokens minted before a restart stay good for their lifetime).
KEEP_VERIFY_KEYS = 4


class PlacementTokenError(Exception):
    """A token that does not allow this write; the message says why."""


@dataclass(frozen=True)
class Claims:
    """What a placement token allows: attempt ``attempt`` of ``request_id`` written by
    prefill worker ``prefill_worker_id`` into the region with digest ``region_digest`` of
    decode worker ``decode_worker_id``, until ``expires_unix_s``."""

    request_id: str
    attempt: int
    decode_worker_id: str
    prefill_worker_id: str
    region_digest: str
    expires_unix_s: float


def region_digest(transport: str, address: str, region_id: str) -> str:
    """The identity of a registered KV region (hex SHA-256 of its transport, address and
    registration id): what a decode worker registers and a token names."""
    text = "\0".join((transport, address, region_id))
    return hashlib.sha256(text.encode()).hexdigest()


def new_signing_key() -> Ed25519PrivateKey:
    """A fresh private key (a scheduler without ``--placement-signing-key-file``)."""
    return Ed25519PrivateKey.generate()


def load_signing_key(path: str) -> Ed25519PrivateKey:
    """The Ed25519 private key in the PEM file ``path`` (``openssl genpkey -algorithm
    ed25519``); ``ValueError`` saying why it cannot be used."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as e:
        raise ValueError(f"cannot read the placement signing key {path}: {e.strerror}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a PEM private key without a passphrase: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 key (openssl genpkey -algorithm ed25519)")
    return key


def verify_key_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``key``: what workers are told."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class VerifyKeys:
    """The scheduler public keys a worker accepts tokens from: the newest first, at most
    ``KEEP_VERIFY_KEYS``. Owned by the worker's event loop (the registrar adds, the
    servicer reads)."""

    def __init__(self) -> None:
        self._keys: list[bytes] = []

    def add(self, key: bytes) -> None:
        """Accept ``key`` (32 raw bytes; anything else is ignored) as the newest."""
        if len(key) != 32 or (self._keys and self._keys[0] == key):
            return
        self._keys = [key, *(k for k in self._keys if k != key)][:KEEP_VERIFY_KEYS]

    def keys(self) -> tuple[bytes, ...]:
        return tuple(self._keys)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(key: Ed25519PrivateKey, claims: Claims) -> str:
    """The token for ``claims``, signed with ``key``."""
    body = {
        "r": claims.request_id,
        "a": claims.attempt,
        "w": claims.decode_worker_id,
        "p": claims.prefill_worker_id,
        "d": claims.region_digest,
        "e": claims.expires_unix_s,
    }
    signed = f"{VERSION}.{_b64(json.dumps(body, separators=(',', ':')).encode())}"
    return f"{signed}.{_b64(key.sign(signed.encode()))}"


def _signed_by(keys: Iterable[bytes], signed: str, signature: bytes) -> bool:
    for raw in keys:
        try:
            Ed25519PublicKey.from_public_bytes(raw).verify(signature, signed.encode())
            return True
        except (InvalidSignature, ValueError):
            continue
    return False


def verify(keys: Iterable[bytes], token: str, expected: Claims, now_unix_s: float) -> Claims:
    """The token's claims when one of ``keys`` signed it, it is unexpired at
    ``now_unix_s`` and it names ``expected``'s request, attempt, workers and region
    (``expected.expires_unix_s`` is ignored); else ``PlacementTokenError`` saying what is
    wrong."""
    keys = tuple(keys)
    if not token:
        raise PlacementTokenError("no placement token: the scheduler did not place this write")
    if not keys:
        raise PlacementTokenError(
            "no scheduler key yet (this worker has not registered): cannot check the token"
        )
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise PlacementTokenError("malformed placement token")
    signed = f"{parts[0]}.{parts[1]}"
    try:
        signature = _unb64(parts[2])
    except (binascii.Error, ValueError):
        raise PlacementTokenError("malformed placement token") from None
    if not _signed_by(keys, signed, signature):
        raise PlacementTokenError(
            "placement token signature is invalid (forged, tampered, or from another scheduler)"
        )
    try:
        body = json.loads(_unb64(parts[1]))
        got = Claims(
            str(body["r"]), int(body["a"]), str(body["w"]), str(body["p"]), str(body["d"]),
            float(body["e"]),
        )  # fmt: skip
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise PlacementTokenError("malformed placement token") from None
    if got.expires_unix_s <= now_unix_s:
        raise PlacementTokenError(
            f"placement token expired {now_unix_s - got.expires_unix_s:.0f}s ago"
        )
    for what, mine, theirs in (
        ("request", got.request_id, expected.request_id),
        ("attempt", got.attempt, expected.attempt),
        ("decode worker", got.decode_worker_id, expected.decode_worker_id),
        ("prefill worker", got.prefill_worker_id, expected.prefill_worker_id),
    ):
        if mine != theirs:
            raise PlacementTokenError(f"placement token is for {what} {mine!r}, not {theirs!r}")
    if got.region_digest != expected.region_digest:
        raise PlacementTokenError(
            "placement token is for another KV region than the destination given"
        )
    return got


def verify_write(
    keys: Iterable[bytes],
    token: str,
    *,
    request_id: str,
    attempt: int,
    decode_worker_id: str,
    prefill_worker_id: str,
    transport: str,
    address: str,
    region_id: str,
    now_unix_s: float,
) -> Claims:
    """``verify`` for prefill worker ``prefill_worker_id`` writing attempt ``attempt`` of
    ``request_id``'s KV into the region (``transport``, ``address``, ``region_id``) of
    ``decode_worker_id``: what a prefill worker checks."""
    digest = region_digest(transport, address, region_id)
    expected = Claims(request_id, attempt, decode_worker_id, prefill_worker_id, digest, 0.0)
    return verify(keys, token, expected, now_unix_s)

"""Placement tokens: the scheduler's signed word that a prefill worker may write one
request's KV into one decode worker's registered region.

The scheduler mints a token at ``Place`` over (request id, decode worker id, the digest of
the decode worker's KV region, an expiry); the gateway hands it to the decode worker, which
passes it on in ``PrefillRequest``; the prefill worker checks it against the request and the
destination handle it was given before it connects a writer. Without the key (the cluster
token) nobody can mint one, so a caller cannot aim a prefill worker at memory the scheduler
did not place.

Form: ``v1.<claims>.<mac>``, both parts unpadded base64url; claims are compact JSON
``{"r": request_id, "w": decode_worker_id, "d": region_digest, "e": expiry_unix_s}``; mac is
HMAC-SHA256 over the ``v1.<claims>`` text with the placement key
(``ClusterAuth.placement_key``, itself derived from the cluster token). The claims are
readable (ids and a digest, no secret) so a refusal can say what did not match. Expiry is
wall clock: hosts' clocks must agree to within the token's lifetime.

Pure: no I/O, the clock is an argument.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass

VERSION = "v1"
DEFAULT_TTL_S = 600.0


class PlacementTokenError(Exception):
    """A token that does not allow this write; the message says why."""


@dataclass(frozen=True)
class Claims:
    """What a placement token allows: ``request_id``'s KV into the region with digest
    ``region_digest`` of decode worker ``decode_worker_id``, until ``expires_unix_s``."""

    request_id: str
    decode_worker_id: str
    region_digest: str
    expires_unix_s: float


def region_digest(transport: str, address: str, region_id: str) -> str:
    """The identity of a registered KV region (hex SHA-256 of its transport, address and
    registration id): what a decode worker registers and a token names."""
    text = "\0".join((transport, address, region_id))
    return hashlib.sha256(text.encode()).hexdigest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, signed: str) -> bytes:
    return hmac.new(key, signed.encode(), hashlib.sha256).digest()


def mint(key: bytes, claims: Claims) -> str:
    """The token for ``claims``, signed with ``key``."""
    body = {
        "r": claims.request_id,
        "w": claims.decode_worker_id,
        "d": claims.region_digest,
        "e": claims.expires_unix_s,
    }
    signed = f"{VERSION}.{_b64(json.dumps(body, separators=(',', ':')).encode())}"
    return f"{signed}.{_b64(_mac(key, signed))}"


def verify(key: bytes, token: str, expected: Claims, now_unix_s: float) -> Claims:
    """The token's claims when it is signed with ``key``, unexpired at ``now_unix_s`` and
    names ``expected``'s request, decode worker and region (``expected.expires_unix_s`` is
    ignored); else ``PlacementTokenError`` saying what is wrong."""
    if not token:
        raise PlacementTokenError("no placement token: the scheduler did not place this write")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise PlacementTokenError("malformed placement token")
    signed = f"{parts[0]}.{parts[1]}"
    try:
        mac = _unb64(parts[2])
    except (binascii.Error, ValueError):
        raise PlacementTokenError("malformed placement token") from None
    if not hmac.compare_digest(mac, _mac(key, signed)):
        raise PlacementTokenError("placement token signature is invalid (forged or tampered)")
    try:
        body = json.loads(_unb64(parts[1]))
        got = Claims(str(body["r"]), str(body["w"]), str(body["d"]), float(body["e"]))
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise PlacementTokenError("malformed placement token") from None
    if got.expires_unix_s <= now_unix_s:
        raise PlacementTokenError(
            f"placement token expired {now_unix_s - got.expires_unix_s:.0f}s ago"
        )
    if got.request_id != expected.request_id:
        raise PlacementTokenError(
            f"placement token is for request {got.request_id!r}, not {expected.request_id!r}"
        )
    if got.decode_worker_id != expected.decode_worker_id:
        raise PlacementTokenError(
            f"placement token is for decode worker {got.decode_worker_id!r}, "
            f"not {expected.decode_worker_id!r}"
        )
    if not hmac.compare_digest(got.region_digest, expected.region_digest):
        raise PlacementTokenError(
            "placement token is for another KV region than the destination given"
        )
    return got


def verify_write(
    key: bytes,
    token: str,
    *,
    request_id: str,
    decode_worker_id: str,
    transport: str,
    address: str,
    region_id: str,
    now_unix_s: float,
) -> Claims:
    """``verify`` for a write of ``request_id``'s KV into the region (``transport``,
    ``address``, ``region_id``) of ``decode_worker_id``: what a prefill worker checks."""
    digest = region_digest(transport, address, region_id)
    return verify(key, token, Claims(request_id, decode_worker_id, digest, 0.0), now_unix_s)

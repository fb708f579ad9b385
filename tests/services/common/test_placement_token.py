"""services.common.placement_token: a token the scheduler mints allows exactly one
attempt of one request's write, by one prefill worker, into one decode worker's region,
until it expires; only the scheduler's private key mints one."""

from __future__ import annotations

import pytest

from services.common.placement_token import (
    KEEP_VERIFY_KEYS,
    Claims,
    PlacementTokenError,
    VerifyKeys,
    mint,
    new_signing_key,
    region_digest,
    verify,
    verify_key_bytes,
    verify_write,
)

KEY = new_signing_key()
PUBLIC = (verify_key_bytes(KEY),)
NOW = 1_800_000_000.0
REGION = region_digest("shm", "/dev/shm/pdserve-kv-1", "decode-0/abc")
CLAIMS = Claims("req-1", 0, "decode-0", "prefill-0", REGION, NOW + 600)


def _claims(**changes: object) -> Claims:
    fields = {**CLAIMS.__dict__, "expires_unix_s": 0.0, **changes}
    return Claims(**fields)  # type: ignore[arg-type]


def test_a_minted_token_verifies_and_returns_its_claims() -> None:
    assert verify(PUBLIC, mint(KEY, CLAIMS), CLAIMS, NOW) == CLAIMS
    assert verify_write(
        PUBLIC, mint(KEY, CLAIMS), request_id="req-1", attempt=0, decode_worker_id="decode-0",
        prefill_worker_id="prefill-0", transport="shm", address="/dev/shm/pdserve-kv-1",
        region_id="decode-0/abc", now_unix_s=NOW,
    ) == CLAIMS  # fmt: skip


def test_region_digest_names_transport_address_and_region_id() -> None:
    digests = {
        region_digest("shm", "/dev/shm/a", "r1"),
        region_digest("tcp", "/dev/shm/a", "r1"),
        region_digest("shm", "/dev/shm/b", "r1"),
        region_digest("shm", "/dev/shm/a", "r2"),
        region_digest("shm", "/dev/shm/a\0r", "1"),  # no ambiguity at the joins
    }
    assert len(digests) == 5


@pytest.mark.parametrize(
    ("expected", "now", "needle"),
    [
        (_claims(request_id="req-2"), NOW, "for request 'req-1', not 'req-2'"),
        (_claims(attempt=1), NOW, "for attempt 0, not 1"),
        (_claims(decode_worker_id="decode-1"), NOW, "for decode worker 'decode-0'"),
        (_claims(prefill_worker_id="prefill-1"), NOW, "for prefill worker 'prefill-0'"),
        (
            _claims(region_digest=region_digest("shm", "/dev/shm/other", "x")),
            NOW,
            "another KV region",
        ),
        (CLAIMS, NOW + 601, "expired 1s ago"),
        (CLAIMS, NOW + 600, "expired"),  # the expiry instant is already too late
    ],
)
def test_a_token_for_anything_else_is_refused(expected: Claims, now: float, needle: str) -> None:
    with pytest.raises(PlacementTokenError, match=needle):
        verify(PUBLIC, mint(KEY, CLAIMS), expected, now)


def test_forged_tampered_missing_and_malformed_tokens_are_refused() -> None:
    token = mint(KEY, CLAIMS)
    with pytest.raises(PlacementTokenError, match="signature is invalid"):
        # signed by another key (a worker's own): only the scheduler's key mints
        verify(PUBLIC, mint(new_signing_key(), CLAIMS), CLAIMS, NOW)
    with pytest.raises(PlacementTokenError, match="signature is invalid"):
        verify((verify_key_bytes(new_signing_key()),), token, CLAIMS, NOW)
    version, claims, mac = token.split(".")
    # claims for another request, signed by nobody: the old signature does not cover them
    other = mint(KEY, _claims(request_id="req-2", expires_unix_s=NOW + 600)).split(".")[1]
    with pytest.raises(PlacementTokenError, match="signature is invalid"):
        verify(PUBLIC, f"{version}.{other}.{mac}", CLAIMS, NOW)
    flipped = mac[:-2] + ("A" if mac[-2] != "A" else "B") + mac[-1]
    with pytest.raises(PlacementTokenError, match="signature is invalid"):
        verify(PUBLIC, f"{version}.{claims}.{flipped}", CLAIMS, NOW)
    with pytest.raises(PlacementTokenError, match="no placement token"):
        verify(PUBLIC, "", CLAIMS, NOW)
    with pytest.raises(PlacementTokenError, match="no scheduler key yet"):
        verify((), token, CLAIMS, NOW)  # a worker that has not registered checks nothing
    for bad in ("v2", "v1.a.b", "v2.a.b.c", "v2.a.!!!", "v2.a.b"):
        with pytest.raises(PlacementTokenError, match=r"malformed|signature"):
            verify(PUBLIC, bad, CLAIMS, NOW)


def test_a_worker_keeps_the_newest_scheduler_keys() -> None:
    """Tokens minted just before a scheduler restart stay good: a worker keeps a few of
    the keys it was told, newest first."""
    keys = VerifyKeys()
    told = [verify_key_bytes(new_signing_key()) for _ in range(KEEP_VERIFY_KEYS + 1)]
    for k in told:
        keys.add(k)
        keys.add(k)  # every heartbeat repeats it
    keys.add(b"short")  # not a key
    assert keys.keys() == tuple(reversed(told))[:KEEP_VERIFY_KEYS]

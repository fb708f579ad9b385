"""services.common.placement_token: a token the scheduler mints allows exactly one
request's write into one decode worker's region, until it expires."""

from __future__ import annotations

import pytest

from services.common.placement_token import (
    Claims,
    PlacementTokenError,
    mint,
    region_digest,
    verify,
    verify_write,
)

KEY = b"k" * 32
NOW = 1_800_000_000.0
REGION = region_digest("shm", "/dev/shm/pdserve-kv-1", "decode-0/abc")
CLAIMS = Claims("req-1", "decode-0", REGION, NOW + 600)


def test_a_minted_token_verifies_and_returns_its_claims() -> None:
    assert verify(KEY, mint(KEY, CLAIMS), CLAIMS, NOW) == CLAIMS
    assert verify_write(
        KEY, mint(KEY, CLAIMS), request_id="req-1", decode_worker_id="decode-0",
        transport="shm", address="/dev/shm/pdserve-kv-1", region_id="decode-0/abc",
        now_unix_s=NOW,
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
        (Claims("req-2", "decode-0", REGION, 0), NOW, "for request 'req-1', not 'req-2'"),
        (Claims("req-1", "decode-1", REGION, 0), NOW, "for decode worker 'decode-0'"),
        (
            Claims("req-1", "decode-0", region_digest("shm", "/dev/shm/other", "x"), 0),
            NOW,
            "another KV region",
        ),
        (CLAIMS, NOW + 601, "expired 1s ago"),
        (CLAIMS, NOW + 600, "expired"),  # the expiry instant is already too late
    ],
)
def test_a_token_for_anything_else_is_refused(expected: Claims, now: float, needle: str) -> None:
    with pytest.raises(PlacementTokenError, match=needle):
        verify(KEY, mint(KEY, CLAIMS), expected, now)


def test_forged_tampered_missing_and_malformed_tokens_are_refused() -> None:
    token = mint(KEY, CLAIMS)
    with pytest.raises(PlacementTokenError, match="signature is invalid"):
        verify(b"another key", token, CLAIMS, NOW)  # minted without the cluster's key
    version, claims, mac = token.split(".")
    # claims for another request, signed by nobody: the old mac does not cover them
    other = mint(KEY, Claims("req-2", "decode-0", REGION, NOW + 600)).split(".")[1]
    with pytest.raises(PlacementTokenError, match="signature is invalid"):
        verify(KEY, f"{version}.{other}.{mac}", CLAIMS, NOW)
    flipped = mac[:-2] + ("A" if mac[-2] != "A" else "B") + mac[-1]
    with pytest.raises(PlacementTokenError, match="signature is invalid"):
        verify(KEY, f"{version}.{claims}.{flipped}", CLAIMS, NOW)
    with pytest.raises(PlacementTokenError, match="no placement token"):
        verify(KEY, "", CLAIMS, NOW)
    for bad in ("v1", "v2.a.b", "v1.a.b.c", "v1.a.!!!"):
        with pytest.raises(PlacementTokenError, match=r"malformed|signature"):
            verify(KEY, bad, CLAIMS, NOW)

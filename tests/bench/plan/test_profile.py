"""Profile lookups (interpolation, extrapolation) and its JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.plan.measure import ProfileConfig
from bench.plan.profile import Profile, ProfileError


def _profile(**overrides: object) -> Profile:
    fields: dict[str, object] = {
        "prefill_tokens": (128, 512, 1024),
        "prefill_s": (0.1, 0.5, 1.2),
        "decode_batches": (1, 8),
        "decode_contexts": (256, 1024),
        "decode_step_s": ((0.05, 0.07), (0.10, 0.16)),
    }
    fields.update(overrides)
    return Profile(**fields)  # type: ignore[arg-type]


def test_prefill_is_linear_between_points_and_proportional_beyond() -> None:
    p = _profile()
    assert p.prefill_seconds(512) == pytest.approx(0.5)
    assert p.prefill_seconds(320) == pytest.approx(0.1 + 0.5 * 0.4)  # halfway 128..512
    assert p.prefill_seconds(768) == pytest.approx(0.5 + 0.5 * 0.7)  # halfway 512..1024
    assert p.prefill_seconds(64) == pytest.approx(0.1 * 64 / 128)
    assert p.prefill_seconds(2048) == pytest.approx(1.2 * 2)


def test_decode_step_is_bilinear_inside_the_grid() -> None:
    p = _profile()
    assert p.decode_step_seconds(8, 1024) == pytest.approx(0.16)
    # context 640 is halfway: batch-1 row 0.06, batch-8 row 0.13; batch 4.5 is halfway.
    assert p.decode_step_seconds(4.5, 640) == pytest.approx(0.095)
    assert p.decode_step_seconds(1, 640) == pytest.approx(0.06)


def test_decode_step_clamps_below_and_extrapolates_above_the_grid() -> None:
    p = _profile()
    assert p.decode_step_seconds(1, 100) == pytest.approx(0.05)
    assert p.decode_step_seconds(0.5, 256) == pytest.approx(0.05)
    assert p.decode_step_seconds(16, 256) == pytest.approx(0.10 + 0.05 / 7 * 8)
    assert p.decode_step_seconds(1, 2048) == pytest.approx(0.07 + 0.02 / 768 * 1024)
    # A measured drop (noise) is not extrapolated downwards: the slope is floored at zero.
    noisy = _profile(decode_step_s=((0.05, 0.04), (0.10, 0.16)))
    assert noisy.decode_step_seconds(1, 4096) == pytest.approx(0.04)


def test_single_point_axes_are_constant() -> None:
    p = _profile(decode_batches=(4,), decode_contexts=(512,), decode_step_s=((0.03,),))
    assert p.decode_step_seconds(1, 64) == 0.03
    assert p.decode_step_seconds(64, 4096) == 0.03
    one = Profile((100,), (0.2,), (4,), (512,), ((0.03,),))
    assert one.prefill_seconds(300) == pytest.approx(0.6)


def test_transfer_seconds_needs_both_figures() -> None:
    assert _profile().transfer_seconds(1000) is None
    p = _profile(kv_bytes_per_token=46_080, kv_transfer_bytes_per_s=4.608e9)
    assert p.transfer_seconds(1000) == pytest.approx(0.01)


def test_json_round_trip(tmp_path: Path) -> None:
    p = _profile(
        kv_bytes_per_token=46_080,
        num_layers=30,
        kv_transfer_bytes_per_s=6.5e9,
        kv_transfer_transport="shm",
        threads=2,
        model="/models/x.gguf",
        created="2025-01-01T00:00:00+0000",
        machine={"cpu_model": "AMD EPYC", "cpu_count": 2, "load_before": [0.5, 0.4, 0.3]},
    )
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    path = tmp_path / "sub" / "profile.json"
    p.save(path)
    assert Profile.load(path) == p
    lists = _profile(prefill_tokens=[128, 512, 1024], decode_step_s=[[0.05, 0.07], [0.10, 0.16]])
    assert lists == _profile()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="something-else"), "format"),
        (lambda d: d.pop("decode"), "the decode section is missing"),
        (lambda d: d.update(decode=[1]), "decode must be an object"),
        (lambda d: d["prefill"].update(tokens=[512, 128, 1024]), "strictly increase"),
        (lambda d: d["prefill"].update(tokens=["128", 512, 1024]), "integers"),
        (lambda d: d["prefill"].update(seconds=[0.1, -0.5, 1.2]), "positive"),
        (lambda d: d["prefill"].update(seconds="fast"), "must be a list"),
        (lambda d: d["decode"].update(step_seconds=[[0.05, 0.07]]), "one row per"),
        (lambda d: d["decode"]["step_seconds"][1].append(0.2), "2 value"),
        (lambda d: d["kv"].update(transfer_bytes_per_s=0), "transfer_bytes_per_s"),
        (lambda d: d.update(threads=0), "threads"),
    ],
)
def test_from_dict_rejects_malformed_profiles(mutate: object, message: str) -> None:
    data = _profile().to_dict()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(data)


def test_load_reports_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not found"):
        Profile.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "pdserve-plan-profile/1", "prefill": ')
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.load(bad)
    wrong = tmp_path / "list.json"
    wrong.write_text("[1, 2, 3]")
    with pytest.raises(ProfileError, match="must be an object"):
        Profile.load(wrong)


def test_profile_config_rejects_bad_grids() -> None:
    with pytest.raises(ValueError, match="strictly increase"):
        ProfileConfig(decode_batches=(8, 1))
    with pytest.raises(ValueError, match=">= 1"):
        ProfileConfig(prefill_tokens=(0, 128))
    with pytest.raises(ValueError, match="transfer"):
        ProfileConfig(transfer="rdma")
    with pytest.raises(ValueError, match="repeats"):
        ProfileConfig(repeats=0)

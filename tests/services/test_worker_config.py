"""The services' command lines: environment defaults checked like flags, bad values are
usage errors before anything starts, and ``--help`` answers without loading torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.decode.config import load_config as decode_config
from services.prefill.__main__ import main as prefill_main
from services.prefill.config import load_config as prefill_config
from tests.services.procs import REPO


def test_a_bad_environment_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"PDSERVE_PREFILL_ENGINE_CPUS": "100000"}  # no such core
    with pytest.raises(SystemExit) as exc:
        prefill_config([], env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "PDSERVE_PREFILL_ENGINE_CPUS='100000'" in err
    assert "cores [100000] are not within" in err
    assert prefill_config([], {"PDSERVE_PREFILL_ENGINE_CPUS": "0"}).tuning.engine_cpus == {0}
    with pytest.raises(SystemExit) as exc:
        decode_config([], {"PDSERVE_DECODE_PORT": "many"})
    assert exc.value.code == 2
    assert "PDSERVE_DECODE_PORT='many'" in capsys.readouterr().err


def test_a_core_it_may_not_use_stops_the_worker_before_it_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        prefill_main(["--engine-cpus", "100000"])
    assert exc.value.code == 2
    assert "argument --engine-cpus: '100000': cores [100000]" in capsys.readouterr().err


def test_worker_defaults() -> None:
    prefill, decode = prefill_config([], {}), decode_config([], {})
    assert (prefill.worker.port, decode.worker.port) == (50061, 50071)
    assert prefill.transports == ("shm", "tcp") and decode.transport == "shm"
    assert decode.prefill_deadline_s == 30.0 and prefill.worker.drain_timeout_s == 30.0
    assert decode_config(["--log-level", "WARNING"], {}).worker.log_level == "warning"


def test_the_prefill_deadline_is_a_decode_setting(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"PDSERVE_DECODE_PREFILL_DEADLINE_S": "12.5"}
    assert decode_config([], env).prefill_deadline_s == 12.5
    assert decode_config(["--prefill-deadline-s", "7"], env).prefill_deadline_s == 7.0  # flag wins
    with pytest.raises(SystemExit) as exc:
        decode_config(["--prefill-deadline-s", "0"], {})
    assert exc.value.code == 2
    assert "prefill_deadline_s must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module", ["services.prefill", "services.decode", "services.gateway", "services.scheduler"]
)
def test_help_is_fast_and_names_the_environment(module: str) -> None:
    code = (
        "import runpy, sys; sys.argv = ['x', '--help']\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    assert done.stdout.rstrip().endswith("NO-TORCH"), "--help imported torch"
    service = module.rsplit(".", 1)[1].upper()
    assert f"PDSERVE_{service}_<FLAG>" in done.stdout
    assert "--log-level" in done.stdout and "--drain-timeout-s" in done.stdout


def test_the_kv_store_settings(capsys: pytest.CaptureFixture[str]) -> None:
    off = prefill_config([], {}).store
    assert off.kv_store is None and not off.enabled  # no master named: no store
    # PDSERVE_KV_STORE is read by every worker alike
    env = {"PDSERVE_KV_STORE": "kv-store:50090"}
    assert prefill_config([], env).store.enabled and decode_config([], env).store.enabled
    assert not decode_config(["--kv-store-segment-mib", "0"], env).store.enabled
    for bad in (["--kv-store-segment-mib", "8"], ["--kv-store", "no-port"],
                ["--kv-store-replicas", "0"], ["--kv-store-load-timeout-s", "0"]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            decode_config(bad, {})
        assert exc.value.code == 2, bad
    assert "at least 16" in capsys.readouterr().err

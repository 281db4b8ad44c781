"""tools/device_check.py, the prepared GPU check, runs: its checks that need no GPU pass on the CPU (smoke run)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.base("0.19.8", reason="the device check runs the 0.19.8 series (its divide count)")
def test_device_check_cpu_smoke_run_passes(tmp_path):
    report = tmp_path / "device-check.md"
    env = {**os.environ, "DEVICE_CHECK_CPU_SMOKE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(_free_port()), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "device_check.py"), str(report)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line for line in report.read_text().splitlines() if line.startswith("| check_")]
    assert len(rows) == 2 and all("| pass |" in row for row in rows), report.read_text()

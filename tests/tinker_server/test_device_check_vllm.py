"""tools/device_check_vllm.py, the GPU check of ``serve --sampler vllm``, run with ``--tiny`` on the CPU.

Its own file (not test_vllm_sampler.py's): it starts its own server, so pytest-xdist can run it beside that module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker_sdk_helpers import requires_vllm

pytestmark = [pytest.mark.pr("zero-0-1"), requires_vllm]


def test_the_gpu_device_check_runs_its_steps_on_a_tiny_model(tmp_path: Path) -> None:
    """tools/device_check_vllm.py (a 1.1B Qwen3 on one GPU, where one is lent) with ``--tiny`` on the CPU: every step
    runs and reports (the server with vLLM, LoRA training through the SDK, sampling, the rank's memory)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "tools" / "device_check_vllm.py"
    report = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(script), str(report), "--tiny", "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = report.read_text().splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        "model", "server with vLLM", "training step (LoRA 32, 4 x 64 tokens)", "sampling on vLLM (32 concurrent)",
        "rank's GPU memory allocated"]
    assert all(" | ok | " in row for row in rows)

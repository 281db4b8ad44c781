"""What the benchmark ran on: the machine, the software, and the patch series of the installed DeepSpeed."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        import psutil
        return round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        return None


def _git(repo: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), *args],
                              check=True,
                              capture_output=True,
                              text=True,
                              env={
                                  **os.environ, "GIT_CONFIG_GLOBAL": os.devnull,
                                  "GIT_CONFIG_NOSYSTEM": "1"
                              }).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _series_titles(version: str) -> list | None:
    """The titles of the PRs a ``pip install .`` of this checkout gives ``version`` (``0.19.8+gafollowups.9``: the
    first 9 of patches/deepspeed-0.19.8/series), or None when the version is not one of the checkout's series."""
    base, _, local = version.partition("+")
    count = local.rpartition(".")[2]
    series = Path(__file__).resolve().parents[2] / "patches" / f"deepspeed-{base}" / "series"
    if not count.isdigit() or not series.is_file():
        return None
    titles = [line.split(" ", 1)[1] for line in series.read_text().splitlines() if line and not line.startswith("#")]
    return titles if len(titles) == int(count) else None


def deepspeed_series() -> dict:
    """The installed DeepSpeed's version and its PRs: the commits of an editable install of the series, else the
    titles of the checkout's series when the version says it is that series (the ``pip install .`` of
    tools/test.sh)."""
    import deepspeed
    info = {"version": deepspeed.__version__, "source": None, "commits": None, "uncommitted_changes": None}
    package = Path(deepspeed.__file__).resolve().parent
    top = _git(package, "rev-parse", "--show-toplevel")
    if top and _git(Path(top), "rev-parse", "-q", "--verify", "refs/tags/upstream") is not None:
        info["source"] = top
        log = _git(Path(top), "log", "--reverse", "--format=%s", "upstream..HEAD")
        info["commits"] = [line for line in (log or "").splitlines() if line]
        status = _git(Path(top), "status", "--porcelain", "--untracked-files=no", "--", "deepspeed", "op_builder",
                      "accelerator")
        info["uncommitted_changes"] = bool(status)
    else:
        info["commits"] = _series_titles(info["version"])
    return info


def describe() -> dict:
    import torch
    info = {
        "os": f"{platform.system()} {platform.release()}",
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_devices": [],
        "deepspeed": deepspeed_series(),
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info

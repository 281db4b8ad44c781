"""What DeepSpeed computes with a prefix of the series, computed on this machine and cached per machine.

Floating-point kernels differ by instruction set, so a bit-level reference holds only on the CPU that
computed it: nothing here is committed. A reference tree is the pinned sdist with the series' first K PRs
applied, materialized by ``ds_series.stack`` and imported straight from its folder by W fresh rank processes
(nothing is installed); the ranks run one case table of ``ds_harness.support.reference_run.TABLES``. Two references are
used: the leading bug-fix PRs (``fix-*``) and no unmanaged PR, for the default-behaviour check, and no PR at
all (pristine 0.19.3), for the bug fixes' own promise. Results are cached under ``<stack cache>/reference/``
keyed by everything that can change them: the CPU model and flags, the accelerator, the Python and torch
versions, the pinned sdist, the applied patches, the case table and the test sources that define the runs.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_series.stack import Base

#: This folder and the harness package above it: their sources define the runs (part of the cache key).
SUPPORT = Path(__file__).resolve().parent
HARNESS = SUPPORT.parent
#: Bug-fix PRs of the series carry this short-name prefix and come before every unmanaged PR.
BUG_FIX_PREFIX = "fix-"
#: The case table of the default-behaviour check (``ds_harness.support.reference_run.TABLES``).
DEFAULT_TABLE = "default"
#: How long the reference ranks may take for all cases together (JIT builds included).
TIMEOUT = float(os.environ.get("DS_SERIES_REFERENCE_TIMEOUT", "1800"))


def tested_base() -> Base:
    """The base under test (``ds_series.stack.installed_base``, as tests/conftest.py finds it)."""
    from ds_series import stack
    return stack.installed_base()


def bug_fix_prefix(base: Base) -> list:
    """The series' leading bug-fix PRs: the reference tree applies these and nothing else."""
    prefix = []
    for patch in base.series():
        if not patch.name.startswith(BUG_FIX_PREFIX):
            break
        prefix.append(patch)
    return prefix


def machine_fingerprint() -> dict[str, str]:
    """What decides the last bits of a floating-point result on this machine."""
    import torch

    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key in ("model name", "flags", "Features", "CPU part") and key not in cpu:
                cpu[key] = value
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "machine": platform.machine(),
        "cpu": json.dumps(cpu, sort_keys=True) or platform.processor(),
        "gpus": ",".join(gpus),
        "python": sys.version,
        "torch": torch.__version__,
        "cpu_count": str(os.cpu_count()),  # the ranks' intra-op thread count follows it
    }


def series_prefix(base: Base, upto: int | None = None) -> list:
    """The PRs a reference tree applies: the series' first ``upto`` (None: the leading bug-fix PRs)."""
    if upto is None:
        return bug_fix_prefix(base)
    from ds_series import stack
    return stack.select(base.series(), upto)


def cache_key(base: Base, world_size: int, upto: int | None = None, table: str = DEFAULT_TABLE) -> str:
    """The cached results' name: everything that can change what ``table`` computes on the tree of ``upto``."""
    h = hashlib.sha256()
    h.update(json.dumps(machine_fingerprint(), sort_keys=True).encode())
    h.update(f"{base.sha256} w{world_size} {table}".encode())
    for patch in series_prefix(base, upto):
        h.update(patch.path.read_bytes())
    for source in sorted(SUPPORT.glob("*.py")) + [HARNESS / "worker.py"]:
        h.update(source.name.encode() + source.read_bytes())
    return h.hexdigest()[:32]


def reference_results(world_size: int,
                      upto: int | None = None,
                      table: str = DEFAULT_TABLE,
                      base: Base | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every result of ``reference_run.TABLES[table]`` per rank on the sdist plus the series' first ``upto`` PRs
    (None: the bug-fix PRs only; 0: pristine) of ``base`` (default: the tested one), from the cache or computed
    now."""
    from ds_series import stack

    base = base or tested_base()
    cached = stack.cache_dir() / "reference" / f"{cache_key(base, world_size, upto, table)}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    results = _compute(base, world_size, series_prefix(base, upto), table)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_text(json.dumps(results, sort_keys=True))
    partial.replace(cached)
    return results


def _compute(base: Base, world_size: int, prs: list, table: str) -> dict[str, list[dict[str, Any]]]:
    """``table`` run by W fresh ranks on the sdist plus ``prs``."""
    from ds_harness import launch
    from local_ranks import ranks
    from local_ranks.procs import kill_tree

    # A stable tree path. DeepSpeed's JIT-built ops (CPU Adam, async I/O) are keyed by their source and include
    # paths: built from the tree into the installed DeepSpeed's extension folder, they would rebuild each side's in
    # turn. The ranks therefore build them from the installed DeepSpeed's sources when those are the tree's (the
    # same build, already done, see _installed_ops_with_the_same_sources), else from the tree into its own folder.
    tree = _reference_tree(base, prs)
    backend = launch.backend()
    installed_ops = _installed_ops_with_the_same_sources(tree)

    tree_env = dict(os.environ)  # the tree's DeepSpeed, imported from its folder; our packages from the virtualenv
    if installed_ops is not None:
        tree_env["PYTHONPATH"] = os.pathsep.join([str(installed_ops), str(tree)])
    else:
        tree_env["PYTHONPATH"] = str(tree)
        tree_env["TORCH_EXTENSIONS_DIR"] = str(tree.parent / "torch_extensions")
    cpu = backend != "nccl"

    # The tree's JIT ops are built here, in one process, not by the ranks inside the cases that first need them.
    subprocess.run([sys.executable, "-m", "ds_series.build_ops"],
                   env=ranks.rank_env(0, world_size, None, cpu=cpu, base=tree_env),
                   cwd=tempfile.gettempdir(),
                   check=True,
                   timeout=TIMEOUT)
    with tempfile.TemporaryDirectory(prefix="ds-reference-") as tmp:
        argv = [sys.executable, "-m", "ds_harness.support.pristine", tmp, str(tree), backend, table]
        procs = ranks.start_ranks(argv,
                                  world_size,
                                  cpu=cpu,
                                  env=tree_env,
                                  cwd=tmp,
                                  log_dir=Path(tmp))
        failed = []
        try:
            for rank, proc in enumerate(procs):
                if proc.wait(timeout=TIMEOUT) != 0:
                    failed.append(rank)
        except subprocess.TimeoutExpired:
            failed = list(range(world_size))
        finally:
            for proc in procs:
                kill_tree(proc.pid)
        if failed:
            tails = "\n".join(f"--- rank {r} ---\n" + (Path(tmp) / f"rank{r}.log").read_text(errors="replace")[-4000:]
                              for r in failed)
            raise RuntimeError(f"the reference run of {table} on {tree} (sdist + {len(prs)} PR(s)) failed:\n{tails}")
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]
    return {name: [per_rank[r][name] for r in range(world_size)] for name in per_rank[0]}


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*")) if path.is_file() and "__pycache__" not in path.parts
    }


def _installed_ops_with_the_same_sources(tree: Path) -> Path | None:
    """The installed DeepSpeed's ``deepspeed/ops`` folder if the tree's JIT ops build from the same sources there.

    That is the case when the op builders (``op_builder/``) and every source file and include folder of the ops
    the reference builds (``ds_series.build_ops``) are byte-identical in the tree and in the installed DeepSpeed,
    i.e. when no PR of the series changed them. The reference ranks then put that folder first on their path:
    DeepSpeed's accelerators take a top-level ``op_builder`` package before their own, and the installed one
    resolves the sources inside the installed package, so the ranks load the very binaries the installed
    DeepSpeed built, from its extension folder, instead of compiling the same sources again (minutes per base).
    (The folder's other entries, ``adam``, ``aio`` and the like, become top-level names too; nothing imports those.)
    None when anything differs: the tree then builds its own.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ds_series.build_ops import OPS

    ops = Path(deepspeed.__file__).resolve().parent / "ops"
    if _files(tree / "op_builder") != _files(ops / "op_builder"):
        return None
    for name, _ in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            continue
        for rel in builder.strip_empty_entries(builder.sources() + builder.include_paths()):
            if Path(rel).is_absolute():
                continue
            ours, theirs = tree / rel, ops / rel
            if ours.is_dir() and theirs.is_dir():
                same = _files(ours) == _files(theirs)
            elif ours.is_file() and theirs.is_file():
                same = ours.read_bytes() == theirs.read_bytes()
            else:  # e.g. an include folder the builder names and neither side has (the CPU comm op's)
                same = not ours.exists() and not theirs.exists()
            if not same:
                return None
    return ops


def _reference_tree(base: Base, prs: list) -> Path:
    """The sdist plus ``prs`` (the series' first ones) of ``base``, materialized once under the cache (a plain tree,
    no git metadata)."""
    from ds_series import stack

    h = hashlib.sha256(base.sha256.encode())
    for patch in prs:
        h.update(patch.path.read_bytes())
    tree = stack.cache_dir() / "reference-trees" / h.hexdigest()[:16] / "deepspeed"
    if not (tree / "deepspeed" / "__init__.py").exists():
        staging = tree.with_name("staging")
        shutil.rmtree(staging, ignore_errors=True)
        stack.materialize(base, staging, upto=len(prs), require_extras=False)
        shutil.rmtree(staging / ".git")
        shutil.rmtree(tree, ignore_errors=True)
        staging.rename(tree)
    return tree


def _rank_main(out: str, tree: str, backend: str, table: str) -> None:
    """One reference rank: every case of ``table`` in turn, each from the same start state as a test rank's.

    Like a test rank, it dumps every thread's stack if it crashes (a CI run once lost a rank with nothing but
    "terminate called without an active exception" in its log), and it leaves with ``os._exit`` once its results
    are written, skipping an interpreter teardown that can block or abort in gloo's and the C++ ops' destructors.
    """
    faulthandler.enable(all_threads=True)
    import deepspeed

    if not deepspeed.__file__.startswith(tree):
        raise RuntimeError(f"imported {deepspeed.__file__}, not the reference tree {tree}")
    from ds_harness.runner import SETTINGS
    from ds_harness.support.reference_run import TABLES, fixed_run
    from ds_harness.worker import _flush_and_exit, _reset_state
    from local_ranks.ranks import disable_cpu_shm_allreduce

    if backend == "nccl":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    else:
        disable_cpu_shm_allreduce()
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    workdir = Path(out, "work")
    results = {}
    for name in TABLES[table]:
        _reset_state(SETTINGS.seed)
        results[name] = fixed_run(name, str(workdir), table)
    Path(out, f"rank{deepspeed.comm.get_rank()}.json").write_text(json.dumps(results))
    deepspeed.comm.barrier()
    _flush_and_exit(0)


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])

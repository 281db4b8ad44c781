"""The rank process: initialise the process group once, then run tasks until told to stop.

Started by ``pools.RankPool`` as ``python -c BOOT`` with its rank
environment, stdout/stderr going to a per-rank log file, and one end of a socketpair.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import importlib.util
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
import types
from multiprocessing.connection import Connection
from typing import Any, Callable

from . import protocol as P

# Signal the parent sends to make a (possibly hung) rank dump every thread's Python stack.
STACK_SIGNAL = signal.SIGUSR1


def main() -> None:
    conn = Connection(int(os.environ[P.ENV_FD]))
    rank = int(os.environ["RANK"])
    # Stacks on crash and on demand: a rank stuck in a C-level collective still answers,
    # since faulthandler's handler runs without the GIL.
    faulthandler.enable(all_threads=True)
    faulthandler.register(STACK_SIGNAL, all_threads=True, chain=False)
    _exit_with_parent()
    try:
        info = _init_process_group()
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        _flush_and_exit(1)
    # Imports (torch, DeepSpeed) leave ~10^6 objects; freezing them keeps the per-test
    # gc.collect() at milliseconds instead of a few hundred on a loaded 2-core machine.
    gc.collect()
    gc.freeze()
    conn.send(("ready", info))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break
        if task is None:
            break
        outcome = _run(task, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(outcome)
    # os._exit: skip interpreter teardown, which can block in NCCL/gloo destructors.
    _flush_and_exit(0)


def _flush_and_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent() -> None:
    """Die with pytest even if it exits without shutting the pool down (a busy rank never sees EOF).

    Linux: the kernel sends SIGKILL when the parent exits (no thread to clutter stack dumps).
    Elsewhere: a watcher thread polls the parent pid.
    """
    parent = int(os.environ.get(P.ENV_PARENT_PID, os.getppid()))
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # parent died before prctl took effect
                os._exit(3)
            return

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def _init_process_group() -> dict[str, Any]:
    """Initialise once per pool, via deepspeed.comm unless the pool is a torch-only one.

    Going through deepspeed.comm leaves DeepSpeed's own communication backend initialised,
    so a later ``deepspeed.initialize()`` finds the group ready instead of creating one.
    """
    import torch
    import torch.distributed as dist

    from ds_series.cpu_info import ask_cpu_info_once

    ask_cpu_info_once()
    backend = os.environ[P.ENV_BACKEND]
    local_rank = int(os.environ["LOCAL_RANK"])
    use_ds = os.environ[P.ENV_INIT] == "deepspeed"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if use_ds:
        import deepspeed
        import deepspeed.comm as ds_comm
        from deepspeed.accelerator import get_accelerator

        if backend == "nccl":
            get_accelerator().set_device(local_rank)
        else:
            from local_ranks.ranks import disable_cpu_shm_allreduce

            disable_cpu_shm_allreduce()
        ds_comm.init_distributed(dist_backend=backend, verbose=False)
        via = f"deepspeed.comm (deepspeed {deepspeed.__version__})"
    else:
        dist.init_process_group(backend=backend)
        via = "torch.distributed"
    return {"pid": os.getpid(), "backend": dist.get_backend(), "via": via, "torch": torch.__version__}


def _run(task: dict[str, Any], rank: int) -> dict[str, Any]:
    try:
        _sync_cwd(task)
        body = _resolve(task)
        args, kwargs = pickle.loads(task["payload"])
        _reset_state(task["seed"])
        value = body(*args, **kwargs)
        try:
            blob = pickle.dumps(value)
        except Exception as exc:
            return P.make_outcome(rank, P.ERROR, summary=f"return value is not picklable: {exc!r}")
        return P.make_outcome(rank, P.OK, value=blob)
    except BaseException as exc:  # noqa: B036 - SystemExit/KeyboardInterrupt in a body must not kill the rank
        reason = _skip_reason(exc)
        if reason is not None:
            return P.make_outcome(rank, P.SKIP, summary=reason)
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return P.make_outcome(rank, P.ERROR, summary=summary, traceback=_format_tb(exc))
    finally:
        gc.collect()  # free engines/buffers of this test before the next one on this rank


def _sync_cwd(task: dict[str, Any]) -> None:
    """Run in the parent's cwd; test modules import their helpers from installed packages (ds_harness)."""
    if os.getcwd() != task["cwd"]:
        os.chdir(task["cwd"])


def _resolve(task: dict[str, Any]) -> Callable[..., Any]:
    obj: Any = _load_module(task["module"], task["path"])
    for part in task["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _load_module(name: str, path: str) -> types.ModuleType:
    """Import the test module under the parent's name, by file path if the name alone fails.

    Same name as in the parent: objects of classes defined in the test module then pickle
    by reference in both directions.
    """
    mod = sys.modules.get(name)
    if mod is not None and _same_file(mod, path):
        return mod
    try:
        mod = importlib.import_module(name)
        if _same_file(mod, path):
            return mod
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load test module {name!r} from {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def _same_file(mod: types.ModuleType, path: str) -> bool:
    f = getattr(mod, "__file__", None)
    return f is not None and os.path.realpath(f) == os.path.realpath(path)


def _reset_state(seed: int) -> None:
    """Same seed on every rank, and undo global torch state a previous test on this rank may have set."""
    import torch

    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA devices too
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _skip_reason(exc: BaseException) -> str | None:
    import unittest

    if isinstance(exc, unittest.SkipTest):
        return str(exc)
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None and isinstance(exc, outcomes.Skipped):
        return str(exc.msg)
    return None


def _format_tb(exc: BaseException) -> str:
    """Traceback without this module's frames: the first frame shown is the test's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


BOOT = "from ds_harness.worker import main; main()"

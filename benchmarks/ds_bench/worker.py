"""A rank host: one long-lived process per rank that forks a fresh child for every trial.

The host imports torch and DeepSpeed (and loads the JIT-built ops a trial will need) once; each
trial then runs in a forked child with its own process group, so trials start in about a second,
share no allocator state, and one trial's peak memory is its own. The launcher
(:mod:`ds_bench.launch`) talks to the host with JSON lines:

* in on stdin: ``{"id": ..., "port": ..., "spec": {...}, "out": "/path/result.json"}`` or ``{"quit": true}``;
* out on stdout: ``{"id": ..., "pid": child}`` when the child starts, ``{"id": ..., "exit": code}`` when it ends.

Run as ``python -m ds_bench.worker [--preload shm_comm,cpu_adam,async_io]`` with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_SIZE`` and ``MASTER_ADDR`` set; each trial sets ``MASTER_PORT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this process when its parent dies (no orphan left in a collective)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reply(message: dict, stream) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _preload(names) -> dict:
    """Build (first use) or load the named DeepSpeed ops, so forked trials inherit them loaded.

    DeepSpeed keeps loaded ops in ``OpBuilder._loaded_ops``, so a trial then neither rebuilds nor takes
    torch's build lock (a trial killed while holding that lock would leave it stale for everyone).

    Returns ``{op: reason}`` for the ops that cannot be built here; trials that need them are skipped.
    """
    # The builders DeepSpeed itself loads: deepspeed.ops.op_builder picks the accelerator's CPU Adam and
    # async I/O; the CPU backend's shared-memory all-reduce comes from the accelerator (comm/torch.py).
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import op_builder
    builders = {
        "cpu_adam": lambda: op_builder.CPUAdamBuilder(),
        "async_io": lambda: op_builder.AsyncIOBuilder(),
        "shm_comm": lambda: get_accelerator().create_op_builder("ShareMemCommBuilder"),
    }
    errors = {}
    for name in names:
        try:
            builder = builders[name]()
            if builder is None:
                continue
            if not builder.is_compatible(verbose=False):
                errors[name] = f"{builder.name} is not compatible with this machine (is libaio-dev installed?)"
                continue
            builder.load(verbose=False)
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            errors[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    return errors


#: DeepSpeed modules a trial may import lazily. Importing them in the host fixes the code every trial
#: runs, even if the DeepSpeed tree is edited while a long run is under way.
_TRIAL_MODULES = (
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.parameter_offload",
    "deepspeed.runtime.zero.partitioned_param_coordinator",
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    "deepspeed.runtime.bf16_optimizer",
    "deepspeed.runtime.fp16.fused_optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer",
    "deepspeed.ops.adam",
)


def _import_trial_modules() -> None:
    import importlib
    for name in _TRIAL_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional module; the trial reports what it needs
            pass


def _run_child(request: dict) -> int:
    os.environ["MASTER_PORT"] = str(request["port"])
    from ds_bench.trial import run_trial_safely
    result = run_trial_safely(request["spec"])
    tmp = request["out"] + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle)
    os.replace(tmp, request["out"])
    return 0 if result["status"] in ("ok", "unsupported") else 1


def serve(preload) -> None:
    # Our replies go to the launcher on the real stdout; everything else printed (DeepSpeed's logs) goes
    # to stderr, which the launcher keeps in a log file.
    _die_with_parent()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    import deepspeed  # noqa: F401
    import torch  # noqa: F401 - imported once here, inherited by every trial

    import ds_bench.trial  # noqa: F401
    _import_trial_modules()
    errors = _preload(preload)
    imported = {"version": deepspeed.__version__, "file": deepspeed.__file__}  # the launcher checks which build
    _reply({"ready": True, "pid": os.getpid(), "preload_errors": errors, "deepspeed": imported}, replies)

    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _die_with_parent()
                replies.close()
                code = _run_child(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _reply({"id": request["id"], "pid": pid}, replies)
        _, status = os.waitpid(pid, 0)
        _reply({"id": request["id"], "exit": os.waitstatus_to_exitcode(status)}, replies)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preload",
                        default="",
                        help="comma-separated ops to load first: shm_comm, cpu_adam, async_io")
    args = parser.parse_args(argv)
    serve([name for name in args.preload.split(",") if name])


if __name__ == "__main__":
    main()

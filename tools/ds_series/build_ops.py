"""Build DeepSpeed's JIT ops (CPU Adam, shared-memory comm, async I/O) once, in one process.

DeepSpeed compiles these on first use, under a lock in ``$TORCH_EXTENSIONS_DIR``. Left to the ranks of a
test, minutes of compiling land inside a rank's timeout while the other ranks wait on the lock, and a rank
killed mid-build leaves the lock behind for every later run. ``tools/test.sh`` runs this after each install,
and the pristine reference run (``ds_harness.support.pristine``) before it starts its ranks.

Usage: ``python -m ds_series.build_ops`` (or ``ds-series-build-ops``) with the DeepSpeed to build for importable
(installed, or on PYTHONPATH).
"""

from __future__ import annotations

#: (op builder, whether the tests need it everywhere); async I/O needs libaio and only NVMe offload uses it.
OPS = (("ShareMemCommBuilder", True), ("CPUAdamBuilder", True), ("AsyncIOBuilder", False))


def build_ops() -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name, required in OPS:
        builder = accelerator.create_op_builder(name)
        try:
            if builder is None or not builder.is_compatible(verbose=False):
                raise RuntimeError("not compatible with this machine")
            builder.load(verbose=False)
        except Exception as err:
            if required:
                raise
            print(f"[build_ops] warning: {name} unavailable ({err}); NVMe offload tests will be skipped")


def main() -> int:
    build_ops()
    return 0


if __name__ == "__main__":
    main()

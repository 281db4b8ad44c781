#!/usr/bin/env bash
# The 0.19.8 series' GPU-only paths on one CUDA GPU (FusedAdam, NCCL at world size 1, ZenFlow, SuperOffload,
# DeepCompile, the gradient-API matrix on CUDA), in at most 8 minutes: tools/device_check.py, on the series'
# source tree rather than an installed wheel, so that it runs on a machine with CUDA torch and no package index.
#
# Prepare on a machine with the package index, from the repository root:
#   python3 tools/ds_series/stack.py materialize                 # deepspeed-src/0.19.8: the whole series
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl -r tools/device_check_wheels.txt
# Run on the GPU machine, from the repository root (with deepspeed-src/0.19.8 and .whl copied beside the code):
#   bash tools/device_check.sh [report.md]
# The report (a Markdown table, one row per check) goes to the argument, default $OUT/device-check.md or
# device-check.md; the exit status is 1 if any check failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPORT="${1:-${OUT:-.}/device-check.md}"
SITE="${DEVICE_CHECK_SITE:-/tmp/device-check-site}"

if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$ROOT"/.whl/*.whl || exit 1
fi
export PYTHONPATH="$ROOT/deepspeed-src/0.19.8:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# JIT-built ops (FusedAdam, CPU Adam for offload) go beside the report's run, built once per machine
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/device-check-extensions}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 480 python3 "$ROOT/tools/device_check.py" "$REPORT"

#!/usr/bin/env bash
# The Tinker-protocol server demo: a 2-rank CPU server on DeepSpeed's unmanaged mode, driven by the
# official tinker SDK (an SFT loop with a varying number of forward_backward calls per step).
#
#   bash examples/tinker_server/run_demo.sh [demo options, e.g. --rank 0 --zero-stage 0 --steps 12]
#
# Uses $PYTHON (default: python on PATH), which must already have torch and the patched DeepSpeed
# (see the README). The SDK and the server's other dependencies (requirements/tinker-server.txt)
# are installed into it on first use. The SDK does not clash with the server's dependencies, so
# the client runs in the same environment; pass --client-python to run it from another one.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"
if ! "$PY" -c "import tinker, peft, transformers, zstandard" >/dev/null 2>&1; then
    echo "[demo] installing requirements/tinker-server.txt into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet -r requirements/tinker-server.txt
fi
exec "$PY" -m examples.tinker_server demo "$@"

#!/usr/bin/env bash
# The Tinker-protocol server demos: a 2-rank CPU server on DeepSpeed's unmanaged mode, driven by clients
# nobody here wrote.
#
#   bash examples/tinker/run_demo.sh [rl] [options]   # RL: tinker-cookbook's RL loop (the default)
#   bash examples/tinker/run_demo.sh sft [options]    # SFT: the official tinker SDK, variable N per step
#   bash examples/tinker/run_demo.sh recipes [options]  # tinker-cookbook's recipes/sl_basic, unmodified
#
# Options go to `deepspeed-tinker rl-demo`, `... demo` or `... recipes-demo` (e.g. --zero-stage 3).
# Uses $PYTHON (default: python on PATH), which must already have torch and the patched DeepSpeed (see
# the README). The SDK, the server's other dependencies (requirements/tinker-server.txt) and tinker-cookbook
# (requirements/tinker-cookbook.txt, installed with --no-deps: see there why) and the server itself (server/, with
# the rank launcher of harness/, editable) are installed into it on first use.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"
DEMO=rl-demo
case "${1:-}" in
    rl) shift ;;
    sft) DEMO=demo; shift ;;
    recipes) DEMO=recipes-demo; shift ;;
esac
if ! "$PY" -c "import tinker, peft, transformers, zstandard, chz, datasets, fastapi, uvicorn" >/dev/null 2>&1; then
    echo "[demo] installing requirements/tinker-server.txt into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet -r requirements/tinker-server.txt
fi
if [[ "$DEMO" != demo ]] && ! "$PY" -c "import tinker_cookbook.rl.train" >/dev/null 2>&1; then
    echo "[demo] installing requirements/tinker-cookbook.txt (--no-deps) into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet --no-deps -r requirements/tinker-cookbook.txt
fi
if ! "$PY" -c "import deepspeed_tinker" >/dev/null 2>&1; then
    echo "[demo] installing the server (pip install --no-deps -e tools -e harness -e server) into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet --no-deps -e tools -e harness -e server
fi
exec "$PY" -m deepspeed_tinker "$DEMO" "$@"

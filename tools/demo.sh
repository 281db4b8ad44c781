#!/usr/bin/env bash
# The demo, from a fresh machine, in one command:
#
#   bash tools/demo.sh [demo options]
#
# Creates (or reuses) the same virtualenv as tools/test.sh ($DS_SERIES_VENV, default .venv) with
# torch 2.13.0 and this project installed (`pip install .`), then runs the demo with it.
set -euo pipefail
# shellcheck source=tools/test.sh
source "$(dirname "${BASH_SOURCE[0]}")/test.sh"

# >>> DEMO COMMAND (placeholder until the Tinker-protocol server demo is wired in; then e.g.
#     DEMO=(bash examples/tinker_server/run_demo.sh), which installs its own extra requirements)
DEMO=("$DS_SERIES_PY" examples/rpc_training_loop.py)
# <<<

ds_series_setup
cd "$DS_SERIES_ROOT"
export PYTHON="$DS_SERIES_PY" PATH="$DS_SERIES_VENV/bin:$PATH"
exec "${DEMO[@]}" "$@"

#!/usr/bin/env bash
# The demo, from a fresh machine, in one command:
#
#   bash tools/demo.sh [rl|sft|recipes] [demo options]
#
# Creates (or reuses) the same virtualenv as tools/test.sh ($DS_SERIES_VENV, default .venv) with
# torch 2.13.0 and this project installed (`pip install .`), then runs the demo with it.
set -euo pipefail
# shellcheck source=tools/test.sh
source "$(dirname "${BASH_SOURCE[0]}")/test.sh"

# The Tinker-protocol server on 2 CPU ranks. Default: reinforcement learning driven by tinker-cookbook's
# RL loop (sampling, importance_sampling, a varying number of forward_backward calls per step), printing the
# reward per step. `sft`: the official tinker SDK's SFT loop with a varying number of forward_backward calls
# per step. The simpler RPC-style loop of `zero-0-1` is `python examples/rpc_training_loop.py`.
DEMO=(bash examples/tinker/run_demo.sh)

ds_series_setup
cd "$DS_SERIES_ROOT"
export PYTHON="$DS_SERIES_PY" PATH="$DS_SERIES_VENV/bin:$PATH"
exec "${DEMO[@]}" "$@"

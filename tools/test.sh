#!/usr/bin/env bash
# The whole test suite, from a fresh machine, in one command:
#
#   bash tools/test.sh [pytest options, e.g. --upto 1 --world-sizes 1,2 -x]
#   bash tools/test.sh -n 0                # one process (pytest-xdist's default here: one worker per core, at most 4)
#   bash tools/test.sh --install-only      # only create/update the environment
#   DS_SERIES_BASE=0.19.3 bash tools/test.sh   # the same for DeepSpeed 0.19.3 + its independent series
#
# Creates (or reuses) the virtualenv $DS_SERIES_VENV (default .venv; .venv-<version> for another base than the
# default), installs into it torch 2.13.0, the pinned requirements, this project the README's way (`pip install .`:
# DeepSpeed 0.19.8 with its whole follow-up series; with DS_SERIES_BASE=0.19.3, 0.19.3 with its series) and our own
# packages, editable (DS_SERIES_PACKAGES: the rank launcher local_ranks, the tooling ds_series, the test harness
# ds_harness, the benchmarks ds_bench, the Tinker server deepspeed_tinker), then runs `python -m pytest` over
# tests/ on one pytest-xdist worker per core, at most 4 (a test file stays on one worker, with its module fixtures; the
# Tinker server tests on the session's servers stay on one, so each server starts once: ds_harness.scheduling). A
# later run skips the installs
# unless a requirements file, the patches or the build tooling changed, or the installed DeepSpeed is
# not the full series (e.g. after `ds-series-stack install --upto K`).
#
# tools/demo.sh sources this file for ds_series_setup.
set -euo pipefail

DS_SERIES_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The upstream release to build (patches/deepspeed-<version>/): by default what a plain `pip install .` builds
# (ds_series.stack's DEFAULT_BASE; the stack tool runs as a script, with the standard library only). Each base gets its
# own default virtualenv: .venv for the default one.
# (The whole list is read, then its first line kept: `| head -n 1` would close the pipe early, and under pipefail the
# stack tool's BrokenPipeError would stop this script now and then.)
DS_SERIES_DEFAULT_BASE=$(python3 "$DS_SERIES_ROOT/tools/ds_series/stack.py" bases)
DS_SERIES_DEFAULT_BASE=${DS_SERIES_DEFAULT_BASE%%$'\n'*}
DS_SERIES_BASE="${DS_SERIES_BASE:-$DS_SERIES_DEFAULT_BASE}"
export DS_SERIES_BASE
if [[ "$DS_SERIES_BASE" == "$DS_SERIES_DEFAULT_BASE" ]]; then
    DS_SERIES_VENV="${DS_SERIES_VENV:-.venv}"
else
    DS_SERIES_VENV="${DS_SERIES_VENV:-.venv-$DS_SERIES_BASE}"
fi
case "$DS_SERIES_VENV" in /*) ;; *) DS_SERIES_VENV="$DS_SERIES_ROOT/$DS_SERIES_VENV" ;; esac
DS_SERIES_PY="$DS_SERIES_VENV/bin/python"
# JIT-built ops go with the virtualenv: two builds sharing one folder would rebuild each other's ops.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$DS_SERIES_VENV/torch_extensions}"
# Installed after torch. The Tinker-server tests need the SDK and the server's dependencies.
DS_SERIES_REQUIREMENTS=(requirements/runtime.txt requirements/dev.txt requirements/tinker-server.txt)
# Our own Python packages (each folder has its pyproject.toml), installed editable with --no-deps: the pins above
# are their dependencies.
DS_SERIES_PACKAGES=(launcher tools harness benchmarks server)

# Each line says how long the script has run: an install step that takes minutes shows in CI's log.
_ds_series_log() { echo "[tools/test.sh +${SECONDS}s] $*" >&2; }

# A digest of everything the environment is built from.
_ds_series_inputs_digest() {
    (
        cd "$DS_SERIES_ROOT"
        local f
        # The series' own files (not a README beside them): what `pip install .` builds from.
        for f in "${DS_SERIES_REQUIREMENTS[@]}" requirements/*.txt pyproject.toml tools/ds_series/build_backend.py \
            tools/ds_series/stack.py patches/*/base.toml patches/*/series patches/*/*.patch patches/*/*/*.patch \
            "${DS_SERIES_PACKAGES[@]/%//pyproject.toml}"; do
            [[ "$f" == requirements/vllm.txt ]] && continue  # vLLM's own environment (tools/vllm-env.sh), not this one
            [[ -f "$f" ]] && printf '%s\n' "$f" && cat "$f"
        done
        echo "base $DS_SERIES_BASE"
        "$DS_SERIES_PY" --version 2>&1 || true
    ) | sha256sum | cut -d' ' -f1
}

_ds_series_expected_version() {
    # Run as a script: the stack tool needs only the standard library (nothing is installed yet).
    python3 "$DS_SERIES_ROOT/tools/ds_series/stack.py" --base "$DS_SERIES_BASE" version
}

_ds_series_installed_version() {
    "$DS_SERIES_PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null || true
}

# DeepSpeed JIT-builds its CPU ops on first use; building them here, once per install, keeps minutes of
# compiling out of the tests' timeouts (see tools/ds_series/build_ops.py).
_ds_series_build_ops() {
    _ds_series_log "building DeepSpeed's CPU ops (CPU Adam, shared-memory comm; async I/O where libaio exists)"
    (cd /tmp && "$DS_SERIES_PY" -m ds_series.build_ops)
}

# Our packages, editable from this checkout (setuptools is pinned in requirements/runtime.txt: no isolated build).
_ds_series_install_packages() {
    local editable=() p
    for p in "${DS_SERIES_PACKAGES[@]}"; do editable+=(-e "$DS_SERIES_ROOT/$p"); done
    _ds_series_log "installing our packages, editable: ${DS_SERIES_PACKAGES[*]}"
    # One at a time per checkout (.ci/run installs two virtualenvs at once): each build writes <package>.egg-info
    # into the package's folder.
    mkdir -p "$DS_SERIES_ROOT/build"
    (
        flock 9
        "$DS_SERIES_PY" -m pip --disable-pip-version-check install --quiet --no-deps --no-build-isolation \
            "${editable[@]}"
    ) 9>"$DS_SERIES_ROOT/build/.packages.lock"
}

# Whether our packages are installed editable from this checkout (a virtualenv made from another clone is not).
_ds_series_packages_here() {
    (cd /tmp && "$DS_SERIES_PY" -c 'import sys, ds_series.stack as s; sys.exit(str(s.ROOT) != sys.argv[1])' \
        "$DS_SERIES_ROOT") 2>/dev/null
}

ds_series_setup() {
    local stamp="$DS_SERIES_VENV/.ds-series-inputs" digest expected
    if [[ ! -x "$DS_SERIES_PY" ]]; then
        _ds_series_log "creating virtualenv $DS_SERIES_VENV"
        python3 -m venv "$DS_SERIES_VENV"
    fi
    digest=$(_ds_series_inputs_digest)
    expected=$(_ds_series_expected_version)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$digest" && "$(_ds_series_installed_version)" == "$expected" ]]; then
        _ds_series_packages_here || _ds_series_install_packages
        _ds_series_log "environment up to date (deepspeed $expected)"
        return 0
    fi
    rm -f "$stamp"
    local pip=("$DS_SERIES_PY" -m pip --disable-pip-version-check install --quiet)
    local reqs=() f
    for f in "${DS_SERIES_REQUIREMENTS[@]}"; do
        [[ -f "$DS_SERIES_ROOT/$f" ]] && reqs+=(-r "$DS_SERIES_ROOT/$f")
    done
    _ds_series_log "installing torch==2.13.0 (pinned first: an unpinned torch pulls a multi-GB CUDA build)"
    "${pip[@]}" torch==2.13.0
    _ds_series_log "installing ${DS_SERIES_REQUIREMENTS[*]}"
    "${pip[@]}" "${reqs[@]}"
    # tinker-cookbook declares a dependency the index cannot satisfy; tinker-client.txt pins what it needs.
    _ds_series_log "installing requirements/tinker-cookbook.txt (--no-deps)"
    "${pip[@]}" --no-deps -r "$DS_SERIES_ROOT/requirements/tinker-cookbook.txt"
    _ds_series_log "installing this project: DS_SERIES_BASE=$DS_SERIES_BASE pip install . (DeepSpeed $DS_SERIES_BASE + its series)"
    (cd "$DS_SERIES_ROOT" && "${pip[@]}" --force-reinstall --no-deps .)
    _ds_series_install_packages
    local got
    got=$(_ds_series_installed_version)
    if [[ "$got" != "$expected" ]]; then
        _ds_series_log "error: installed deepspeed is '$got', expected '$expected'"
        return 1
    fi
    _ds_series_build_ops
    echo "$digest" >"$stamp"
    _ds_series_log "installed deepspeed $got into $DS_SERIES_VENV"
}

# vLLM's own environment (tools/vllm-env.sh), for the Tinker server's `--sampler vllm` tests; the default base only
# (the sampler does not depend on the DeepSpeed under the ranks). DS_TINKER_NO_VLLM=1 skips it, and those tests skip.
ds_tinker_vllm_setup() {
    [[ "$DS_SERIES_BASE" == "$DS_SERIES_DEFAULT_BASE" && -z "${DS_TINKER_NO_VLLM:-}" ]] || return 0
    DEEPSPEED_TINKER_VLLM_PYTHON=$(bash "$DS_SERIES_ROOT/tools/vllm-env.sh" | tail -n 1)
    export DEEPSPEED_TINKER_VLLM_PYTHON
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    ds_series_setup
    ds_tinker_vllm_setup
    [[ "${1:-}" == "--install-only" ]] && exit 0
    cd "$DS_SERIES_ROOT"
    # Half of the suite waits (servers starting, long polls, heartbeats, timeouts) with the cores idle: the test files
    # run on one worker per core, at most 4 (each worker keeps rank pools for world sizes up to 4), a file per worker
    # or a folder of tests/conftest.py's WHOLE_ON_ONE_WORKER. `-n` given, or `-p no:xdist`, decides instead.
    workers=()
    if [[ " $* " != *" -n "* && " $* " != *" -n"[0-9]* && " $* " != *"--numprocesses"* && " $* " != *"no:xdist"* ]]; then
        workers=(-n "$(($(nproc) < 4 ? $(nproc) : 4))" --dist loadfile)
    fi
    rc=0
    "$DS_SERIES_PY" -m pytest "${workers[@]}" "$@" || rc=$?
    if [[ $rc -eq 5 ]]; then
        _ds_series_log "error: pytest collected no tests (exit 5); that is a failure here"
        exit 1
    fi
    exit $rc
fi

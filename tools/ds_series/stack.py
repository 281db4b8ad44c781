#!/usr/bin/env python3
"""Maintain the DeepSpeed patch series as a stack of git commits on the pinned upstream sdist.

The project holds only patches. This tool turns them into a git repository to edit
(``materialize``), turns that repository back into patches (``export``), proves the two agree
(``check``) and installs the upstream tree patched up to any prefix of the series (``install``).

The repository keeps one series per upstream release, each in ``patches/deepspeed-<version>/`` with a
``base.toml`` pinning that release's sdist; ``--base <version>`` (or ``$DS_SERIES_BASE``) picks the one
to work on, 0.19.8 by default. A new base is one more such folder. Every function takes the :class:`Base` it works
on (``load_base``): importing the module reads nothing and changes nothing.

Run it as ``ds-series-stack`` or ``python -m ds_series.stack`` where the package is installed, or as
``python3 tools/ds_series/stack.py`` from a checkout with nothing installed.

Only the standard library and the ``git`` and ``pip`` executables are used. Git always runs with
the user's and the system's configuration ignored, so a developer's settings cannot change the
exported bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

UPSTREAM_NAME = "deepspeed"
UPSTREAM_TAG = "upstream"

#: Environment variable naming another checkout of the project to work in (its patches/, deepspeed-src/, build/).
CHECKOUT_ENV = "DS_SERIES_CHECKOUT"
#: The checkout this tool works in: the one it is installed (editable) from, unless ``$DS_SERIES_CHECKOUT`` names one.
ROOT = Path(os.environ.get(CHECKOUT_ENV) or Path(__file__).resolve().parents[2]).resolve()
#: One folder per upstream base, ``patches/deepspeed-<version>/``: ``base.toml`` (the pinned sdist, the series'
#: name, upstream files the sdist lacks), the ``series`` index and one ``<short-name>.patch`` per PR.
PATCHES_ROOT = ROOT / "patches"
#: The base every command works on unless ``--base`` names another: ``$DS_SERIES_BASE`` or this one.
BASE_ENV = "DS_SERIES_BASE"
DEFAULT_BASE = "0.19.8"
#: Environment variable naming the folder of upstream files (see ``[extras]`` in base.toml) to use instead of the
#: one base.toml names.
EXTRAS_ENV = "DS_SERIES_UPSTREAM_FILES"

#: Environment variable naming a local sdist to use instead of downloading one (offline use).
SDIST_ENV = "DS_SERIES_SDIST"
#: Environment variable overriding the sdist cache folder.
CACHE_ENV = "DS_SERIES_CACHE"
#: A folder of prefix wheels built by ``wheels`` (e.g. in the background, while tests run): ``install --upto K``
#: installs prefix K's wheel from there when it holds one, instead of building it again.
WHEELS_ENV = "DS_SERIES_WHEELS"

#: Files that DeepSpeed's setup.py rewrites on every install. They stay tracked (they are part of
#: the pristine tree) but git is told to ignore local changes to them, so an install never makes
#: the materialized tree look edited.
BUILD_OUTPUTS = ("build.txt", "deepspeed/git_version_info_installed.py", "deepspeed.egg-info")
UNTRACKED_BUILD_OUTPUTS = ("build/", "dist/", "*.egg-info/", "__pycache__/", "*.pyc", "*.so")

#: A fixed identity and clock for commits the tool makes, so materializing twice gives one history.
_GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "DeepSpeed Team",
    "GIT_AUTHOR_EMAIL": "deepspeed-info@microsoft.com",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "deepspeed-series",
    "GIT_COMMITTER_EMAIL": "deepspeed-series@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
_GIT_CONFIG = ("-c", "diff.algorithm=myers", "-c", "core.autocrlf=false", "-c", "core.abbrev=12", "-c",
               "user.useConfigOnly=false", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false")
_FORMAT_PATCH = ("format-patch", "--keep-subject", "--no-stat", "--no-signature", "--zero-commit", "--full-index",
                 "--no-numbered", "--stdout")


class StackError(Exception):
    """A failure the user can act on; the CLI prints it without a traceback."""


@dataclass(frozen=True)
class Patch:
    """One PR of the series: its position (1-based), short name and title, and the folder of its patch file (the
    series index's)."""

    index: int
    name: str
    title: str
    folder: Path

    @property
    def path(self) -> Path:
        return self.folder / f"{self.name}.patch"


@dataclass(frozen=True)
class Extras:
    """Upstream files the sdist lacks (its tests/ and docs/), laid into the tree so that PRs can carry tests and
    docs in DeepSpeed's own form. Each is pinned by sha256; the folder they come from is not part of the
    project (``$DS_SERIES_UPSTREAM_FILES`` or ``source`` in base.toml, relative to the repository root)."""

    source: Path
    commit: str
    sha256: dict[str, str]
    #: Where each file can be downloaded when ``source`` is absent: ``{commit}`` and ``{path}`` are filled in.
    url: str | None = None
    #: Upstream changes to these files merged after ``commit`` that the PRs build on (``backports`` in base.toml,
    #: paths relative to the base's folder): each is a git-am patch applied, one commit each, below ``upstream``.
    backports: tuple[Path, ...] = ()

    @property
    def top_levels(self) -> list[str]:
        return sorted({path.split("/", 1)[0] for path in self.sha256})


@dataclass(frozen=True)
class Base:
    """An upstream release the project keeps a series for (``patches/deepspeed-<version>/base.toml``), and where the
    commands work on it: every command takes one."""

    version: str
    sha256: str
    series_tag: str
    #: ``patches/deepspeed-<version>/``: the series index and one patch per PR.
    folder: Path
    extras: Extras | None = None
    #: The development tree (``materialize``, ``export``); default ``deepspeed-src/<version>/``.
    tree_dir: Path = field(default=None)  # type: ignore[assignment]
    #: Where ``install --upto K`` materializes its prefix trees; default ``build/<version>/``.
    prefix_dir: Path = field(default=None)  # type: ignore[assignment]
    #: Whether trees need the base's upstream files (tests/, docs/); False (``--without-upstream-files``) for machines
    #: that have neither the folder nor a way to download them (the PRs are then applied without their tests and
    #: docs).
    require_extras: bool = True

    def __post_init__(self) -> None:
        if self.tree_dir is None:
            object.__setattr__(self, "tree_dir", ROOT / "deepspeed-src" / self.version)
        if self.prefix_dir is None:
            object.__setattr__(self, "prefix_dir", ROOT / "build" / self.version)

    @property
    def sdist_name(self) -> str:
        return f"{UPSTREAM_NAME}-{self.version}.tar.gz"

    @property
    def series_file(self) -> Path:
        return self.folder / "series"

    def series(self) -> list[Patch]:
        """The PRs in stack order."""
        return read_series(self.series_file)


def available_bases() -> list[str]:
    """The versions with a series folder, oldest first."""
    versions = [p.parent.name[len(UPSTREAM_NAME) + 1:] for p in PATCHES_ROOT.glob(f"{UPSTREAM_NAME}-*/base.toml")]
    return sorted(versions, key=lambda v: tuple(int(x) if x.isdigit() else x for x in v.split(".")))


def load_base(version: str) -> Base:
    folder = PATCHES_ROOT / f"{UPSTREAM_NAME}-{version}"
    if not (folder / "base.toml").is_file():
        raise StackError(f"no series for {UPSTREAM_NAME} {version!r}: {folder / 'base.toml'} does not exist "
                         f"(bases: {', '.join(available_bases()) or 'none'})")
    with (folder / "base.toml").open("rb") as f:
        data = tomllib.load(f)
    try:
        upstream, series = data["upstream"], data["series"]
        if upstream["version"] != version:
            raise StackError(f"{folder / 'base.toml'} pins {upstream['version']}, but its folder names {version}")
        extras = None
        if "extras" in data:
            source = os.environ.get(EXTRAS_ENV) or data["extras"]["source"]
            extras = Extras((ROOT / source).resolve(), data["extras"]["commit"], dict(data["extras"]["sha256"]),
                            data["extras"].get("url"), tuple(folder / b for b in data["extras"].get("backports", ())))
        return Base(version, upstream["sha256"], series["tag"], folder, extras)
    except KeyError as err:
        raise StackError(f"{folder / 'base.toml'} lacks {err}") from None


def default_base() -> Base:
    """The base named by ``$DS_SERIES_BASE``, else ``DEFAULT_BASE``."""
    version = os.environ.get(BASE_ENV) or DEFAULT_BASE
    try:
        return load_base(version)
    except StackError as err:
        raise StackError(f"${BASE_ENV}: {err}") from None


def installed_base() -> Base:
    """The base of the DeepSpeed installed for this interpreter if the project has a series for it (the one under
    test), else ``default_base()``."""
    import importlib.metadata

    try:
        installed = importlib.metadata.version(UPSTREAM_NAME).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        installed = ""
    return load_base(installed) if installed in available_bases() else default_base()


def version_for(base: Base, upto: int) -> str:
    """The PEP 440 version of the upstream tree patched with the first ``upto`` PRs."""
    return f"{base.version}+{base.series_tag}.{upto}"


# --------------------------------------------------------------------------------------------
# The series index
# --------------------------------------------------------------------------------------------


def read_series(series_file: Path) -> list[Patch]:
    """Parse a series index: one ``<short-name> <title>`` line per PR, in stack order."""
    patches = []
    for line in series_file.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, title = line.partition(" ")
        patches.append(Patch(len(patches) + 1, name, title.strip(), series_file.parent))
    names = [p.name for p in patches]
    if len(set(names)) != len(names):
        raise StackError(f"{series_file}: duplicate short names in {names}")
    return patches


def write_series(patches: list[Patch], series_file: Path) -> None:
    """Rewrite the index, keeping its header comments."""
    header = [line for line in series_file.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    body = [f"{p.name} {p.title}" for p in patches]
    _write_text(series_file, "\n".join(header + body) + "\n")


def select(patches: list[Patch], upto: int | None) -> list[Patch]:
    if upto is None:
        return patches
    if not 0 <= upto <= len(patches):
        raise StackError(f"--upto must be between 0 and {len(patches)}, got {upto}")
    return patches[:upto]


# --------------------------------------------------------------------------------------------
# fetch
# --------------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sdist(base: Base, path: Path) -> Path:
    expected = base.sha256
    if not path.is_file():
        raise StackError(f"{path} does not exist (set ${SDIST_ENV} to a local {base.sdist_name}, or unset it)")
    actual = sha256_of(path)
    if actual != expected:
        raise StackError(f"sha256 mismatch for {path}:\n  expected {expected}\n  actual   {actual}\n"
                         f"Refusing to use it: the series is pinned to {UPSTREAM_NAME}=={base.version}.")
    return path


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                       "deepspeed-series")
    return Path(base)


def fetch(base: Base) -> Path:
    """Return the verified pinned sdist: from ``$DS_SERIES_SDIST``, the cache, or pip's index."""
    local = os.environ.get(SDIST_ENV)
    if local:
        return verify_sdist(base, Path(local))
    cached = cache_dir() / base.sdist_name
    if cached.exists():
        return verify_sdist(base, cached)
    with tempfile.TemporaryDirectory() as tmp:
        # Through pip, so that the user's own index configuration (pip.conf, PIP_INDEX_URL) applies.
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "-d", tmp, f"{UPSTREAM_NAME}=={base.version}"
        ]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        downloaded = Path(tmp) / base.sdist_name
        if not downloaded.exists():
            raise StackError(f"pip could not download {base.sdist_name}:\n{result.stdout}")
        verify_sdist(base, downloaded)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        shutil.copyfile(downloaded, partial)
        partial.replace(cached)
    return cached


def extract_sdist(base: Base, sdist: Path, dest: Path) -> None:
    """Unpack the sdist's single top-level folder into ``dest``."""
    top = f"{UPSTREAM_NAME}-{base.version}/"
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(top):
                continue
            member.name = member.name[len(top):]
            if member.name:
                members.append(member)
        tar.extractall(dest, members=members, filter="tar")


# --------------------------------------------------------------------------------------------
# git plumbing
# --------------------------------------------------------------------------------------------


def git_env() -> dict[str, str]:
    """The environment every git command of the tools runs in: the user's and the system's configuration
    ignored (no external diff driver, prefix or colour setting can change what is read or written)."""
    env = {**os.environ, **_GIT_ENV}
    # Commits made by a developer keep their own identity and dates.
    for key in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_AUTHOR_DATE", "GIT_COMMITTER_DATE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def git_argv(*args: str) -> list[str]:
    """A git command line with the tools' pinned configuration (run it with ``git_env()``)."""
    return ["git", *_GIT_CONFIG, *args]


def git(repo: Path, *args: str, check: bool = True, input: str | None = None) -> str:
    result = subprocess.run(git_argv(*args), cwd=repo, env=git_env(), input=input, text=True, capture_output=True)
    if check and result.returncode != 0:
        raise StackError(f"git {' '.join(args)} failed in {repo}:\n{result.stderr.strip()}")
    return result.stdout


def init_upstream_repo(base: Base, dest: Path, require_extras: bool | None = None) -> bool:
    """Create ``dest`` as a git repository holding the pristine sdist in one commit, plus the base's upstream
    files the sdist lacks in a second one and one commit per backport to them; the last is tagged ``upstream``.
    Returns whether those files are in.

    Without ``require_extras`` upstream files that are neither in their folder nor cached are not downloaded but
    left out (building a wheel needs only ``deepspeed/``); the PRs are then applied without their tests and docs."""
    if dest.exists():
        raise StackError(f"{dest} already exists; remove it first (after exporting any work in it)")
    require_extras = base.require_extras if require_extras is None else require_extras
    extras = base.extras
    folder = None
    if extras is not None:
        try:
            folder = extras_folder(base, download=require_extras)
        except StackError:
            if require_extras:
                raise
    extract_sdist(base, fetch(base), dest)
    git(dest, "init", "--quiet", "--initial-branch=main")
    (dest / ".git" / "info" / "exclude").write_text("\n".join(UNTRACKED_BUILD_OUTPUTS) + "\n")
    git(dest, "add", "--all", "--force")
    git(dest, "commit", "--quiet", "--no-verify", "-m", f"{UPSTREAM_NAME} {base.version} (pristine sdist)")
    if folder is not None:
        for relative in extras.sha256:
            _write_bytes(dest / relative, (folder / relative).read_bytes())
        git(dest, "add", "--force", "--", *extras.sha256)
        git(dest, "commit", "--quiet", "--no-verify", "-m",
            f"Upstream {', '.join(d + '/' for d in extras.top_levels)} at {extras.commit[:12]} (not in the sdist)")
        for backport in extras.backports:
            result = subprocess.run(["git", *_GIT_CONFIG, "am", "--quiet", "--keep", "--keep-cr", str(backport)],
                                    cwd=dest, env={**os.environ, **_GIT_ENV}, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            if result.returncode != 0:
                raise StackError(f"upstream backport {backport} does not apply:\n{result.stdout.strip()}")
    git(dest, "tag", UPSTREAM_TAG)
    tracked = git(dest, "ls-files", "--", *BUILD_OUTPUTS).split()
    git(dest, "update-index", "--skip-worktree", *tracked)
    return folder is not None


def extras_folder(base: Base, download: bool = True) -> Path:
    """The folder holding the base's pinned upstream files: ``source`` if it exists, else a download of them
    (from ``url``) cached per commit. Every file is checked against its pinned sha256."""
    extras = base.extras
    if extras is None:
        raise StackError(f"{UPSTREAM_NAME} {base.version}'s series needs no upstream files")
    folder = extras.source
    if not folder.is_dir():
        folder = cache_dir() / "upstream-files" / extras.commit
        missing = [relative for relative in extras.sha256 if not (folder / relative).is_file()]
        if missing and (extras.url is None or not download):
            raise StackError(f"{UPSTREAM_NAME} {base.version}'s series needs upstream's "
                             f"{', '.join(d + '/' for d in extras.top_levels)} files at {extras.source} (set "
                             f"${EXTRAS_ENV} to their folder)")
        for relative in missing:
            url = extras.url.format(commit=extras.commit, path=relative)
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    data = response.read()
            except OSError as err:
                raise StackError(f"{extras.source} does not exist and {url} could not be downloaded ({err}); set "
                                 f"${EXTRAS_ENV} to a folder holding upstream's files at {extras.commit}") from None
            partial = (folder / relative).with_suffix(".partial")
            _write_bytes(partial, data)
            partial.replace(folder / relative)
    for relative, expected in extras.sha256.items():
        path = folder / relative
        actual = sha256_of(path) if path.is_file() else "missing"
        if actual != expected:
            raise StackError(f"{path}: sha256 {actual}, expected {expected} (upstream commit {extras.commit})")
    return folder


def apply_patches(repo: Path, patches: list[Patch], exclude: list[str] = ()) -> None:
    """Apply and tag each PR; ``exclude`` leaves out paths matching these patterns (``git apply --exclude``)."""
    for patch in patches:
        if not patch.path.exists():
            raise StackError(f"{patch.path} is listed in the series but missing")
        argv = ["git", *_GIT_CONFIG, "am", "--quiet", "--keep", "--keep-cr", *(f"--exclude={e}" for e in exclude)]
        result = subprocess.run([*argv, str(patch.path)], cwd=repo, env={**os.environ, **_GIT_ENV}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            git(repo, "am", "--abort", check=False)
            raise StackError(f"PR {patch.index} ({patch.path.name}) does not apply:\n{result.stdout.strip()}")
        git(repo, "tag", "--force", patch.name)


def stack_commits(repo: Path) -> list[str]:
    return git(repo, "rev-list", "--reverse", f"{UPSTREAM_TAG}..HEAD").split()


def render_patch(repo: Path, commit: str) -> bytes:
    """One commit as a patch: LF line endings and exactly one final newline."""
    text = git(repo, *_FORMAT_PATCH, f"{commit}~1..{commit}")
    return (text.replace("\r\n", "\n").rstrip("\n") + "\n").encode("utf-8")


def commit_subject(repo: Path, commit: str) -> str:
    return git(repo, "log", "-1", "--format=%s", commit).strip()


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def materialize(base: Base, dest: Path | None = None, upto: int | None = None,
                require_extras: bool | None = None) -> Path:
    """Build the editable repository: pristine commit(s) (tagged ``upstream``) plus one commit per PR."""
    dest = dest or base.tree_dir
    patches = select(base.series(), upto)
    apply_patches(dest, patches, _left_out(base, init_upstream_repo(base, dest, require_extras)))
    return dest


def _left_out(base: Base, with_extras: bool) -> list[str]:
    """``apply_patches``' exclusions for a tree initialised with or without the base's upstream files."""
    extras = base.extras
    return [] if with_extras or extras is None else [f"{d}/*" for d in extras.top_levels]


def squash_fixups(repo: Path) -> None:
    """Fold ``git commit --fixup=<pr-tag>`` commits into their PR, the way to edit a PR in place."""
    subjects = [commit_subject(repo, c) for c in stack_commits(repo)]
    if any(s.startswith(("fixup! ", "squash! ", "amend! ")) for s in subjects):
        env = {**os.environ, "GIT_SEQUENCE_EDITOR": "true", "GIT_EDITOR": "true"}
        result = subprocess.run(["git", *_GIT_CONFIG, "rebase", "--quiet", "-i", "--autosquash", UPSTREAM_TAG],
                                cwd=repo, env={**env, **_GIT_ENV}, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        if result.returncode != 0:
            raise StackError(f"folding fixup commits failed; resolve the rebase in {repo}:\n{result.stdout}")


def export_patches(repo: Path, out_dir: Path, patches: list[Patch]) -> list[Patch]:
    """Write one patch per commit above ``upstream`` into ``out_dir``; return the updated index."""
    commits = stack_commits(repo)
    if len(commits) != len(patches):
        raise StackError(f"{repo} has {len(commits)} commits above '{UPSTREAM_TAG}' but the series lists "
                         f"{len(patches)} PRs. Commit edits with `git commit --fixup=<pr-short-name>`, or add a "
                         f"line to the series file for a new PR.")
    exported = []
    for patch, commit in zip(patches, commits):
        patch = replace(patch, title=commit_subject(repo, commit))
        _write_bytes(out_dir / f"{patch.name}.patch", render_patch(repo, commit))
        exported.append(patch)
    return exported


def export(base: Base, repo: Path | None = None) -> list[Patch]:
    """Regenerate ``patches/`` from the materialized repository (and retag its commits)."""
    repo = repo or base.tree_dir
    if not (repo / ".git").exists():
        raise StackError(f"{repo} is not materialized; run `ds-series-stack materialize` first")
    if git(repo, "status", "--porcelain"):
        raise StackError(f"{repo} has uncommitted changes; commit them (e.g. --fixup=<pr>) before exporting")
    squash_fixups(repo)
    patches = export_patches(repo, base.folder, base.series())
    for patch, commit in zip(patches, stack_commits(repo)):
        git(repo, "tag", "--force", patch.name, commit)
    listed = {p.path.name for p in patches}
    for stale in base.folder.glob("*.patch"):
        if stale.name not in listed:
            stale.unlink()
    write_series(patches, base.series_file)
    return patches


def check(base: Base, repo: Path | None = None) -> list[str]:
    """Return the problems found: patches that do not apply, unexported or uncommitted work."""
    repo = repo or base.tree_dir
    patches = base.series()
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            apply_patches(Path(tmp) / "tree", patches, _left_out(base, init_upstream_repo(base, Path(tmp) / "tree")))
        except StackError as err:
            problems.append(str(err))
    if not (repo / ".git").exists():
        return problems
    status = git(repo, "status", "--porcelain")
    if status:
        problems.append(f"uncommitted changes in {repo}:\n{status.rstrip()}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            exported = export_patches(repo, Path(tmp), patches)
        except StackError as err:
            problems.append(f"unexported commits: {err}")
        else:
            for patch in exported:
                if (Path(tmp) / patch.path.name).read_bytes() != _read_bytes(patch.path):
                    problems.append(f"PR {patch.index} ({patch.name}) in {repo} differs from {patch.path}: "
                                    f"run `ds-series-stack export`")
                if patch.title != patches[patch.index - 1].title:
                    problems.append(f"title of PR {patch.index} differs from the series: run `ds-series-stack export`")
    return problems


def build_env(base: Base, upto: int) -> dict[str, str]:
    """Environment for DeepSpeed's setup.py: JIT ops only and a version naming the series prefix."""
    return {
        **os.environ, "DS_BUILD_OPS": os.environ.get("DS_BUILD_OPS", "0"),
        "DS_BUILD_STRING": f"+{base.series_tag}.{upto}"
    }


def prefix_tree(base: Base, upto: int) -> Path:
    """A fresh tree with the first ``upto`` PRs applied (and their tests and docs), under ``build/`` (ignored)."""
    dest = base.prefix_dir / f"deepspeed-upto-{upto}"
    if dest.exists():
        shutil.rmtree(dest)
    materialize(base, dest, upto)
    return dest


#: DeepSpeed's C++/CUDA op sources, which torch JIT-builds with ninja on first use.
OP_SOURCES = Path(UPSTREAM_NAME) / "ops" / "csrc"


def _installed_op_sources() -> dict[Path, tuple[str, int]]:
    """sha256 and mtime (ns) of each op source of the DeepSpeed installed for this interpreter."""
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"]) / OP_SOURCES
    if not root.is_dir():
        return {}
    return {
        path: (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in root.rglob("*") if path.is_file()
    }


def _keep_op_source_times(before: dict[Path, tuple[str, int]]) -> None:
    """Give each reinstalled op source whose bytes did not change its earlier mtime. ninja rebuilds what is
    older than its sources, so otherwise every reinstall (e.g. one prefix after another) recompiles CPU Adam and
    async I/O on their next use, minutes on a small machine, inside whatever loads them first."""
    for path, (digest, _) in _installed_op_sources().items():
        old_digest, old_mtime_ns = before.get(path, (None, None))
        if old_digest == digest:
            os.utime(path, ns=(path.stat().st_atime_ns, old_mtime_ns))


def wheel_of(base: Base, upto: int, folder: Path) -> Path | None:
    """Prefix ``upto``'s wheel in ``folder`` (its version names the series and the prefix), if it is there."""
    found = sorted(folder.glob(f"{UPSTREAM_NAME}-{version_for(base, upto)}-*.whl"))
    return found[0] if found else None


def build_wheels(base: Base, uptos: list[int], out_dir: Path) -> list[Path]:
    """Build the wheel of each prefix in ``uptos`` into ``out_dir`` with pip, from fresh prefix trees in
    ``out_dir/trees`` (not ``base.prefix_dir``: ``install --upto`` may use that meanwhile). Single-threaded pip
    work that CI runs beside tests; ``install --upto K`` with ``$DS_SERIES_WHEELS=out_dir`` then only installs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = replace(base, prefix_dir=out_dir / "trees")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    wheels = []
    for upto in uptos:
        select(base.series(), upto)
        tree = prefix_tree(base, upto)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            cmd = [*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", tmp, str(tree)]
            if subprocess.run(cmd, env=build_env(base, upto)).returncode != 0:
                raise StackError(f"pip wheel of {tree} failed")
            built = wheel_of(base, upto, Path(tmp))
            if built is None:
                raise StackError(f"pip wheel of {tree} gave no {UPSTREAM_NAME} {version_for(base, upto)} wheel")
            # Whole or not at all: an install looking for it never sees a wheel being written.
            wheels.append(built.replace(out_dir / built.name))
        shutil.rmtree(tree)
    return wheels


def install(base: Base, upto: int | None, editable: bool) -> str:
    """pip-install the tree patched up to PR ``upto`` (default: the materialized development tree); a prefix
    from its wheel in ``$DS_SERIES_WHEELS`` if ``wheels`` built it there."""
    wheels = os.environ.get(WHEELS_ENV)
    prebuilt = wheel_of(base, upto, Path(wheels)) if wheels and upto is not None and not editable else None
    if upto is None:
        tree = base.tree_dir if (base.tree_dir / ".git").exists() else materialize(base)
        upto = len(stack_commits(tree))
    elif prebuilt is not None:
        select(base.series(), upto)
        tree = prebuilt
    else:
        select(base.series(), upto)
        tree = prefix_tree(base, upto)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    op_sources = _installed_op_sources()
    subprocess.run([*pip, "uninstall", "--yes", "--quiet", UPSTREAM_NAME], check=False)
    cmd = [*pip, "install", "--quiet", *(["--editable"] if editable else []), str(tree)]
    if subprocess.run(cmd, env=build_env(base, upto)).returncode != 0:
        raise StackError(f"pip install of {tree} failed")
    if not editable:
        _keep_op_source_times(op_sources)
    return version_for(base, upto)


def submitter_identity(identity: str | None = None) -> str:
    """``Name <email>`` of whoever sends the PRs upstream: ``identity`` if given, else their own git identity
    (read with their configuration, unlike every other git command here)."""
    if identity:
        if not re.fullmatch(r"[^<>\n]+ <[^<>\s]+@[^<>\s]+>", identity.strip()):
            raise StackError(f"--author must look like 'Name <email>', got {identity!r}")
        return identity.strip()
    values = []
    for key in ("user.name", "user.email"):
        result = subprocess.run(["git", "config", "--get", key], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        values.append(result.stdout.strip())
    if not all(values):
        raise StackError("no git identity to sign the patches with: set git's user.name and user.email, or pass "
                         "--author 'Name <email>'")
    return f"{values[0]} <{values[1]}>"


def submit(base: Base, out_dir: Path, identity: str | None = None) -> list[Path]:
    """Write the series for sending upstream into ``out_dir`` (numbered, in stack order): each patch's author
    and ``Signed-off-by`` are the submitter's, as DeepSpeed's DCO check requires. ``patches/`` is untouched
    (it stays byte-reproducible)."""
    identity = submitter_identity(identity)
    name, email = identity[:identity.index(" <")], identity[identity.index(" <") + 2:-1]
    written = []
    for patch in base.series():
        text = _read_bytes(patch.path).decode("utf-8")
        header, sep, rest = text.partition("\nSubject: ")
        if not sep:
            raise StackError(f"{patch.path} is not a format-patch file (no Subject header)")
        header = re.sub(r"^From: .*?(?=^Date: )", f"From: {name} <{email}>\n", header, flags=re.M | re.S)
        message, sep, diff = rest.partition("\ndiff --git ")  # --no-stat: no "---" line before the diff
        message = re.sub(r"^Signed-off-by: .*$\n?", "", message, flags=re.M).rstrip("\n")
        message += f"\n\nSigned-off-by: {name} <{email}>\n"
        dest = out_dir / f"{patch.index:04d}-{patch.name}.patch"
        _write_text(dest, header + "\nSubject: " + message + sep + diff)
        written.append(dest)
    return written


# --------------------------------------------------------------------------------------------
# Small file helpers
# --------------------------------------------------------------------------------------------


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode("utf-8"))


def _read_bytes(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-series-stack", description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, metavar="VERSION",
                        help=f"the upstream release whose series to work on ({', '.join(available_bases())}; "
                        f"default ${BASE_ENV} or {DEFAULT_BASE})")
    parser.add_argument("--without-upstream-files", action="store_true",
                        help="build trees without the base's upstream tests/ and docs/ when they are unavailable "
                        "(the PRs' test and doc hunks are left out)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help=f"download and verify the pinned sdist (or use ${SDIST_ENV})")
    p = sub.add_parser("materialize", help="create deepspeed-src/<version>/: upstream + one commit per PR")
    p.add_argument("--upto", type=int, help="apply only the first K PRs")
    p.add_argument("--force", action="store_true", help="replace an existing tree (its unexported work is lost)")
    sub.add_parser("export", help="regenerate patches/deepspeed-<version>/ from deepspeed-src/<version>/")
    sub.add_parser("check", help="patches apply in order; the materialized tree has nothing unexported")
    sub.add_parser("version", help="print the version `pip install .` gives for the base (the whole series)")
    sub.add_parser("bases", help="print every base, one a line: the default (what a plain `pip install .` builds) "
                   "first, then the others, oldest first")
    sub.add_parser("upstream-files", help="print the folder of the base's upstream tests/ and docs/ (downloading "
                   "them if need be); fails if they are unavailable")
    p = sub.add_parser("submit", help="write the series for sending upstream, signed off by you (DCO)")
    p.add_argument("--author", help="'Name <email>' for From: and Signed-off-by: (default: your git identity)")
    p.add_argument("--out", type=Path, default=ROOT / "dist" / "series", help="folder to write (default: dist/series)")
    p = sub.add_parser("wheels", help=f"build the wheels of prefixes with pip into a folder (for ${WHEELS_ENV})")
    p.add_argument("--upto", type=int, nargs="+", required=True, metavar="K", help="the prefixes")
    p.add_argument("--out", type=Path, required=True, help="the folder")
    p = sub.add_parser("install", help=f"pip-install DeepSpeed patched up to PR K (from its wheel in ${WHEELS_ENV} "
                       "if built there)")
    p.add_argument("--upto", type=int, help="install a fresh tree with the first K PRs (default: the dev tree)")
    p.add_argument("--editable", action=argparse.BooleanOptionalAction, default=None,
                   help="editable install (default: editable for the dev tree, not for --upto)")
    args = parser.parse_args(argv)
    if args.command == "bases":
        print("\n".join([DEFAULT_BASE, *(v for v in available_bases() if v != DEFAULT_BASE)]))
        return 0
    try:
        base = load_base(args.base) if args.base is not None else default_base()
        if args.without_upstream_files:
            base = replace(base, require_extras=False)
        if args.command == "fetch":
            print(fetch(base))
        elif args.command == "materialize":
            if args.force and base.tree_dir.exists():
                shutil.rmtree(base.tree_dir)
            tree = materialize(base, base.tree_dir, args.upto)
            print(f"materialized {len(stack_commits(tree))} PR(s) on '{UPSTREAM_TAG}' in {tree}")
        elif args.command == "export":
            patches = export(base)
            print(f"exported {len(patches)} PR(s) to {base.folder.relative_to(ROOT)}")
        elif args.command == "check":
            problems = check(base)
            if problems:
                print("stack check failed:\n- " + "\n- ".join(problems), file=sys.stderr)
                return 1
            print(f"stack check passed: {len(base.series())} PR(s) apply to {base.sdist_name}; nothing unexported")
        elif args.command == "upstream-files":
            print(extras_folder(base) if base.extras is not None else f"{base.version} needs none")
        elif args.command == "version":
            print(version_for(base, len(base.series())))
        elif args.command == "submit":
            for path in submit(base, args.out, args.author):
                print(path)
        elif args.command == "wheels":
            for wheel in build_wheels(base, args.upto, args.out.resolve()):
                print(f"built {wheel}")
        elif args.command == "install":
            editable = args.editable if args.editable is not None else args.upto is None
            print(f"installed {UPSTREAM_NAME} {install(base, args.upto, editable)}")
    except StackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

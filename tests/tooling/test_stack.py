"""Tests of the stack tool, ds_series.stack (tooling).

Every test works in temporary folders: the module's paths (patches/, the series index, the
materialized tree, the prefix trees) are pointed there, so the project's own ``deepspeed-src/``,
``build/`` and ``patches/`` are never touched. The real pinned sdist is used where a tree is built
(``stack.fetch(BASE)``: ``$DS_SERIES_SDIST``, the cache, or pip's index).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ds_series import stack

ROOT = Path(__file__).resolve().parents[2]

#: The base these tests materialise and install, as the repository holds it: 0.19.3, whose trees need nothing but its
#: sdist (the default base, 0.19.8, also lays upstream's tests/ and docs/ into them). The throwaway project below
#: makes it the default, so the CLI's default path is what runs.
BASE = stack.load_base("0.19.3")
REAL_PATCHES = BASE.folder


@pytest.fixture(scope="session")
def sdist() -> Path:
    """The verified pinned sdist, obtained once (a failure here names the reason)."""
    return stack.fetch(BASE)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sdist: Path) -> Path:
    """A throwaway project root holding a copy of the real patches; the CLI (``stack.main``) works in it."""
    root = tmp_path / "project"
    shutil.copytree(REAL_PATCHES, root / "patches" / REAL_PATCHES.name)
    monkeypatch.setattr(stack, "ROOT", root)
    monkeypatch.setattr(stack, "PATCHES_ROOT", root / "patches")
    monkeypatch.delenv(stack.BASE_ENV, raising=False)
    monkeypatch.setattr(stack, "DEFAULT_BASE", BASE.version)
    monkeypatch.setenv(stack.SDIST_ENV, str(sdist))
    monkeypatch.setenv(stack.CACHE_ENV, str(tmp_path / "cache"))
    return root


@pytest.fixture
def base(project: Path) -> stack.Base:
    """The default base in the throwaway project: its series, development tree and prefix trees are there."""
    base = stack.default_base()
    assert base.folder == project / "patches" / REAL_PATCHES.name
    assert base.tree_dir == project / "deepspeed-src" / base.version
    return base


def _fake_sdist(path: Path) -> Path:
    """A well-formed sdist-shaped tarball whose contents (hence hash) are not the pinned ones."""
    data = b"from setuptools import setup\nsetup(name='deepspeed', version='0.19.3')\n"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"deepspeed-{BASE.version}/setup.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def _tags(repo: Path) -> set[str]:
    return set(stack.git(repo, "tag", "--list").split())


# -- fetch: the pinned hash ---------------------------------------------------------------------


def test_wrong_sdist_hash_is_refused_naming_both_hashes(tmp_path, monkeypatch, capsys):
    fake = _fake_sdist(tmp_path / BASE.sdist_name)
    actual = hashlib.sha256(fake.read_bytes()).hexdigest()
    monkeypatch.setenv(stack.SDIST_ENV, str(fake))
    monkeypatch.setenv(stack.CACHE_ENV, str(tmp_path / "cache"))

    with pytest.raises(stack.StackError) as err:
        stack.fetch(BASE)
    message = str(err.value)
    assert f"expected {BASE.sha256}" in message
    assert f"actual   {actual}" in message

    # Nothing is built from it, and the CLI reports it without a traceback.
    with pytest.raises(stack.StackError, match="sha256 mismatch"):
        stack.materialize(BASE, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()
    assert stack.main(["--base", BASE.version, "fetch"]) == 1
    stderr = capsys.readouterr().err
    assert BASE.sha256 in stderr and actual in stderr and "Traceback" not in stderr


def test_wrong_hash_in_cache_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    _fake_sdist(cache / BASE.sdist_name)
    monkeypatch.delenv(stack.SDIST_ENV, raising=False)
    monkeypatch.setenv(stack.CACHE_ENV, str(cache))
    with pytest.raises(stack.StackError, match=f"expected {BASE.sha256}"):
        stack.fetch(BASE)


def test_missing_local_sdist_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(stack.SDIST_ENV, str(tmp_path / "nowhere.tar.gz"))
    with pytest.raises(stack.StackError, match="does not exist"):
        stack.fetch(BASE)


# -- materialize / export: the round trip --------------------------------------------------------


def test_export_right_after_materialize_is_byte_identical(project, base, tmp_path, monkeypatch):
    # A developer's git configuration must not leak into the exported bytes.
    hostile = tmp_path / "gitconfig"
    hostile.write_text("[format]\n\tsignOff = true\n\theaders = X-Hostile: 1\n\tuseAutoBase = true\n"
                       "[diff]\n\tnoprefix = true\n\talgorithm = histogram\n[core]\n\tabbrev = 7\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(hostile))
    monkeypatch.setenv("HOME", str(tmp_path))

    tree = stack.materialize(base)
    assert tree == base.tree_dir
    series = base.series()
    assert len(stack.stack_commits(tree)) == len(series)
    assert {stack.UPSTREAM_TAG, *(p.name for p in series)} <= _tags(tree)

    for patch in base.folder.glob("*.patch"):
        patch.unlink()  # export must regenerate every patch, not leave the old bytes in place
    stack.export(base)

    exported = {p.name: p.read_bytes() for p in base.folder.iterdir()}
    original = {p.name: p.read_bytes() for p in REAL_PATCHES.iterdir()}
    assert sorted(exported) == sorted(original)
    for name in original:
        assert exported[name] == original[name], f"export changed {name}"
    assert stack.git(tree, "status", "--porcelain") == ""
    assert stack.check(base) == []


# -- check ---------------------------------------------------------------------------------------


@pytest.fixture
def tree(base: stack.Base) -> Path:
    return stack.materialize(base)


def test_check_detects_uncommitted_edit(base, tree, capsys):
    engine = tree / "deepspeed" / "runtime" / "engine.py"
    engine.write_text(engine.read_text() + "# an edit\n")
    problems = stack.check(base)
    assert len(problems) == 1 and "uncommitted changes" in problems[0] and "engine.py" in problems[0]
    assert stack.main(["check"]) == 1
    assert "stack check failed" in capsys.readouterr().err


def test_check_detects_unexported_commit(base, tree):
    (tree / "new_file.py").write_text("x = 1\n")
    stack.git(tree, "add", "new_file.py")
    stack.git(tree, "commit", "--quiet", "--fixup", base.series()[-1].name)
    problems = stack.check(base)
    assert len(problems) == 1 and "unexported commits" in problems[0], problems


def test_check_detects_amended_pr(base, tree):
    (tree / "new_file.py").write_text("x = 1\n")
    stack.git(tree, "add", "new_file.py")
    stack.git(tree, "commit", "--quiet", "--amend", "--no-edit")
    problems = stack.check(base)
    assert len(problems) == 1 and "differs from" in problems[0] and "ds-series-stack export" in problems[0], problems


def test_check_detects_patch_that_does_not_apply(base):
    patch = base.series()[0].path
    lines = patch.read_bytes().split(b"\n")
    hunk = next(i for i, line in enumerate(lines) if line.startswith(b"@@ "))
    context = next(i for i in range(hunk + 1, len(lines)) if lines[i].startswith(b" "))
    lines[context] = b" this context line is not in the pristine file"
    patch.write_bytes(b"\n".join(lines))
    problems = stack.check(base)
    assert any("does not apply" in p for p in problems), problems


# -- --upto K --------------------------------------------------------------------------------------


def test_upto_k_materializes_exactly_k_prs(project, base):
    """A synthetic two-PR series on the real sdist: prefix K has exactly K commits, tagged."""
    series = base.series_file
    for patch in base.folder.glob("*.patch"):
        patch.unlink()
    series.write_text("# test series\nalpha placeholder\nbeta placeholder\n")
    pristine = stack.materialize(base, project / "base", upto=0)
    assert stack.stack_commits(pristine) == []
    for name in ("alpha", "beta"):
        (pristine / f"series-{name}.txt").write_text(f"{name}\n")
        stack.git(pristine, "add", f"series-{name}.txt")
        stack.git(pristine, "commit", "--quiet", "-m", f"Add {name}")
    assert [p.title for p in stack.export(base, pristine)] == ["Add alpha", "Add beta"]
    assert series.read_text() == "# test series\nalpha Add alpha\nbeta Add beta\n"

    for k, names in ((1, ["alpha"]), (2, ["alpha", "beta"])):
        tree = stack.materialize(base, project / f"upto-{k}", upto=k)
        commits = stack.stack_commits(tree)
        assert [stack.commit_subject(tree, c) for c in commits] == [f"Add {n}" for n in names]
        assert _tags(tree) == {stack.UPSTREAM_TAG, *names}
        assert sorted(p.name for p in tree.glob("series-*.txt")) == [f"series-{n}.txt" for n in names]
    with pytest.raises(stack.StackError, match="between 0 and 2"):
        stack.materialize(base, project / "upto-3", upto=3)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_build_env_names_the_prefix(k):
    env = stack.build_env(BASE, k)
    # Literal: tools/test.sh and .ci/run expect exactly these strings.
    assert env["DS_BUILD_STRING"] == f"+unmanagedga.{k}"
    assert stack.version_for(BASE, k) == f"0.19.3+unmanagedga.{k}"


def _pip_into(target, monkeypatch, *extra: str) -> list:
    """Redirect the stack tool's pip installs into ``target`` (an uninstall does nothing); the pip commands it ran."""
    real_run = subprocess.run
    pip_calls = []

    def run(cmd, *args, **kwargs):
        if cmd[1:3] == ["-m", "pip"]:
            pip_calls.append(list(cmd))
            if "uninstall" in cmd:
                return subprocess.CompletedProcess(cmd, 0)
            cmd = [*cmd, "--no-deps", *extra, "--target", str(target)]
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(stack.subprocess, "run", run)
    return pip_calls


def test_install_upto_1_installs_that_prefix(base, tmp_path, monkeypatch):
    """A real `install --upto 1`, redirected into a target folder instead of the running environment."""
    target = tmp_path / "site"
    pip_calls = _pip_into(target, monkeypatch, "--no-build-isolation")
    assert stack.main(["install", "--upto", "1"]) == 0

    assert [c for c in pip_calls if "uninstall" in c], "install must first remove the installed deepspeed"
    [install_cmd] = [c for c in pip_calls if "install" in c]
    assert "--editable" not in install_cmd
    prefix = base.prefix_dir / "deepspeed-upto-1"
    assert len(stack.stack_commits(prefix)) == 1
    installed = (target / "deepspeed" / "git_version_info_installed.py").read_text()
    assert f"version='{stack.version_for(base, 1)}'" in installed
    for rel in ("runtime/engine.py", "runtime/config.py", "runtime/constants.py"):
        assert (target / "deepspeed" / rel).read_bytes() == (prefix / "deepspeed" / rel).read_bytes(), rel


def test_install_upto_1_takes_the_wheel_built_beforehand(base, tmp_path, monkeypatch):
    """`wheels --upto 1` builds prefix 1's wheel with pip (CI does it beside its tests); `install --upto 1` with
    $DS_SERIES_WHEELS then installs that wheel, the same files as a build of the prefix tree, without building."""
    wheels = tmp_path / "wheels"
    assert stack.main(["wheels", "--upto", "1", "--out", str(wheels)]) == 0
    wheel = stack.wheel_of(base, 1, wheels)
    assert wheel is not None and stack.wheel_of(base, 2, wheels) is None
    assert not (wheels / "trees" / "deepspeed-upto-1").exists(), "the tree goes once its wheel is built"
    target = tmp_path / "site"
    pip_calls = _pip_into(target, monkeypatch)
    monkeypatch.setenv(stack.WHEELS_ENV, str(wheels))
    assert stack.main(["install", "--upto", "1"]) == 0
    [install_cmd] = [c for c in pip_calls if "install" in c]
    assert str(wheel) in install_cmd
    assert not (base.prefix_dir / "deepspeed-upto-1").exists(), "nothing is built when the wheel is there"
    installed = (target / "deepspeed" / "git_version_info_installed.py").read_text()
    assert f"version='{stack.version_for(base, 1)}'" in installed


# -- submit: the submitter signs the PRs (DCO) ----------------------------------------------------------------
def test_submit_signs_every_pr_with_the_submitter_and_leaves_patches_alone(base, tmp_path, monkeypatch):
    before = {p.name: p.read_bytes() for p in base.folder.iterdir()}
    out = tmp_path / "outbox"
    written = stack.submit(base, out, "Jane Doe <jane@example.com>")
    series = base.series()
    assert [p.name for p in written] == [f"{p.index:04d}-{p.name}.patch" for p in series]
    for path, patch in zip(written, series):
        text = path.read_text()
        assert "\nFrom: Jane Doe <jane@example.com>\nDate: " in text
        assert text.count("Signed-off-by:") == 1 and "Signed-off-by: Jane Doe <jane@example.com>\n" in text
        # the same change and message otherwise: applies with git am, keeps the subject and the sections
        assert f"Subject: {patch.title}\n" in text and "\n## Testing\n" in text
    tree = stack.materialize(base, tmp_path / "tree", upto=0)
    stack.git(tree, "am", "--quiet", *map(str, written))
    assert stack.git(tree, "log", "--format=%an <%ae>", "upstream..HEAD").split("\n")[:-1] == \
        ["Jane Doe <jane@example.com>"] * len(series)
    assert {p.name: p.read_bytes() for p in base.folder.iterdir()} == before
    # default: the submitter's own git identity; none at all is a clear error
    config = tmp_path / "gitconfig"
    config.write_text("[user]\n\tname = Sam Sender\n\temail = sam@example.org\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.chdir(tmp_path)  # outside any repository with a local identity
    assert "Signed-off-by: Sam Sender <sam@example.org>" in stack.submit(base, tmp_path / "again")[0].read_text()
    config.write_text("")
    with pytest.raises(stack.StackError, match="user.name and user.email"):
        stack.submit(base, tmp_path / "none")
    with pytest.raises(stack.StackError, match="Name <email>"):
        stack.submit(base, tmp_path / "bad", "jane")


# -- bases: one series per upstream release ------------------------------------------------------


def test_every_base_folder_pins_its_release_and_names_its_series():
    assert stack.DEFAULT_BASE == "0.19.8", "`pip install .` builds current DeepSpeed (the README says so)"
    assert stack.available_bases() == sorted(stack.available_bases(), key=lambda v: tuple(map(int, v.split("."))))
    assert stack.DEFAULT_BASE in stack.available_bases()
    for version in stack.available_bases():
        base = stack.load_base(version)
        assert base.folder == ROOT / "patches" / f"deepspeed-{version}"
        assert re.fullmatch(r"[0-9a-f]{64}", base.sha256)
        assert base.series_file == base.folder / "series" and base.series_file.is_file()
        assert base.tree_dir == ROOT / "deepspeed-src" / version
        assert stack.version_for(base, 2) == f"{version}+{base.series_tag}.2"
    tags = [stack.load_base(v).series_tag for v in stack.available_bases()]
    assert len(set(tags)) == len(tags), "each series needs its own version label"


def test_bases_lists_the_default_first(monkeypatch, capsys):
    """tools/test.sh and .ci/run take the default base from `bases`' first line, whatever $DS_SERIES_BASE says."""
    monkeypatch.setenv(stack.BASE_ENV, "0.1.0")
    assert stack.main(["bases"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed[0] == stack.DEFAULT_BASE and sorted(listed) == sorted(stack.available_bases())


def test_a_bad_base_fails_where_it_is_used_not_on_import(monkeypatch, capsys):
    """The module holds no base: every command takes one, so importing it cannot fail on $DS_SERIES_BASE."""
    monkeypatch.setenv(stack.BASE_ENV, "0.1.0")
    result = subprocess.run([sys.executable, "-c", "from ds_series import stack; print(stack.DEFAULT_BASE)"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == stack.DEFAULT_BASE, result.stderr
    with pytest.raises(stack.StackError, match=r"\$DS_SERIES_BASE: no series for deepspeed '0\.1\.0'"):
        stack.default_base()
    assert stack.main(["version"]) == 1
    assert "DS_SERIES_BASE" in capsys.readouterr().err


def test_unknown_base_is_a_clear_error_listing_the_known_ones(capsys):
    with pytest.raises(stack.StackError, match=r"no series for deepspeed '0\.1\.0'.*bases: 0\.19\.3"):
        stack.load_base("0.1.0")
    assert stack.main(["--base", "0.1.0", "check"]) == 1
    assert "base.toml does not exist" in capsys.readouterr().err


def _base_with_extras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sdist: Path) -> stack.Base:
    """The default base with one made-up upstream file to lay into the tree."""
    source = tmp_path / "upstream"
    (source / "tests").mkdir(parents=True)
    (source / "tests" / "conftest.py").write_text("# upstream's\n")
    extras = stack.Extras(source, "0" * 40, {"tests/conftest.py": stack.sha256_of(source / "tests" / "conftest.py")})
    monkeypatch.setenv(stack.SDIST_ENV, str(sdist))
    return dataclasses.replace(BASE, extras=extras)


def test_upstream_files_are_laid_in_below_the_upstream_tag(tmp_path, monkeypatch, sdist):
    base = _base_with_extras(tmp_path, monkeypatch, sdist)
    tree = stack.materialize(base, tmp_path / "tree", upto=0)
    assert (tree / "tests" / "conftest.py").read_text() == "# upstream's\n"
    assert stack.git(tree, "rev-list", "--count", stack.UPSTREAM_TAG).strip() == "2"
    assert "not in the sdist" in stack.commit_subject(tree, stack.UPSTREAM_TAG)


def test_upstream_backports_are_applied_below_the_upstream_tag(tmp_path, monkeypatch, sdist):
    """A change upstream merged after the pinned files (base.toml's ``backports``) is one commit of its own below
    ``upstream``: the PRs apply on top of it and never carry it; one that does not apply is a clear error."""
    base = _base_with_extras(tmp_path, monkeypatch, sdist)
    backport = tmp_path / "backport.patch"
    backport.write_text("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                        "From: DeepSpeed Team <deepspeed-info@microsoft.com>\n"
                        "Date: Sat, 1 Jan 2000 00:00:00 +0000\n"
                        "Subject: Merged upstream later (#1)\n\n"
                        "diff --git a/tests/conftest.py b/tests/conftest.py\n"
                        "--- a/tests/conftest.py\n+++ b/tests/conftest.py\n"
                        "@@ -1 +1 @@\n-# upstream's\n+# upstream's, later\n")
    base = dataclasses.replace(base, extras=dataclasses.replace(base.extras, backports=(backport, )))
    tree = stack.materialize(base, tmp_path / "tree", upto=0)
    assert (tree / "tests" / "conftest.py").read_text() == "# upstream's, later\n"
    assert stack.git(tree, "rev-list", "--count", stack.UPSTREAM_TAG).strip() == "3"
    assert stack.commit_subject(tree, stack.UPSTREAM_TAG) == "Merged upstream later (#1)"
    (base.extras.source / "tests" / "conftest.py").write_text("# upstream's\n")
    backport.write_text(backport.read_text().replace("-# upstream's\n", "-# something else\n"))
    with pytest.raises(stack.StackError, match="backport .* does not apply"):
        stack.materialize(base, tmp_path / "broken", upto=0)


def test_the_0_19_8_series_builds_on_upstreams_8397():
    """The 0.19.8 series' tests compare tensors across ranks with ``allclose_on_all_ranks()``, which needs #8397 on
    the CPU accelerator; upstream merged it after the pinned test tree, so the base carries it, not a PR."""
    base = stack.load_base("0.19.8")
    assert [b.name for b in base.extras.backports] == ["8397-test-device-names.patch"]
    assert all(b.is_file() for b in base.extras.backports)
    hunks = (base.folder / "fix-cpu-test-harness.patch").read_text().split("\ndiff ", 1)[1]
    assert "current_device_name()" not in hunks


def test_upstream_files_are_pinned_and_required_for_a_development_tree(tmp_path, monkeypatch, sdist):
    base = _base_with_extras(tmp_path, monkeypatch, sdist)
    (base.extras.source / "tests" / "conftest.py").write_text("# edited\n")
    with pytest.raises(stack.StackError, match="sha256 .*expected"):
        stack.materialize(base, tmp_path / "edited", upto=0)
    (base.extras.source / "tests" / "conftest.py").write_text("# upstream's\n")
    mirror = tmp_path / "mirror"
    shutil.copytree(base.extras.source, mirror / base.extras.commit)
    shutil.rmtree(base.extras.source)
    monkeypatch.setenv(stack.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(stack.StackError, match=re.escape(stack.EXTRAS_ENV)):
        stack.materialize(base, tmp_path / "missing", upto=0)
    # A wheel needs only deepspeed/: without the folder the tree is built without those files.
    tree = stack.materialize(base, tmp_path / "wheel", upto=0, require_extras=False)
    assert not (tree / "tests").exists()
    assert stack.git(tree, "rev-list", "--count", stack.UPSTREAM_TAG).strip() == "1"
    # With a download address they are fetched once into the cache, and checked there.
    url = f"file://{mirror}/{{commit}}/{{path}}"
    extras = stack.Extras(base.extras.source, base.extras.commit, base.extras.sha256, url)
    tree = stack.materialize(dataclasses.replace(base, extras=extras), tmp_path / "downloaded", upto=0)
    assert (tree / "tests" / "conftest.py").read_text() == "# upstream's\n"
    assert (tmp_path / "cache" / "upstream-files" / base.extras.commit / "tests" / "conftest.py").is_file()


def test_check_without_upstream_files_applies_every_pr_without_its_tests_and_docs(tmp_path, monkeypatch):
    """``stack.py check --without-upstream-files`` (CI where upstream's files are unavailable) leaves out the PRs'
    hunks there, as the wheel build does, instead of failing on the first PR that edits upstream's tests."""
    checked = 0
    for version in stack.available_bases():
        base = stack.load_base(version)
        if base.extras is None:
            continue
        checked += 1
        monkeypatch.setenv(stack.SDIST_ENV, str(stack.fetch(base)))
        monkeypatch.setenv(stack.CACHE_ENV, str(tmp_path / version / "cache"))
        missing = dataclasses.replace(base.extras, source=tmp_path / "missing")
        without = dataclasses.replace(base, extras=missing, require_extras=False)
        assert stack.check(without, tmp_path / version / "no-tree") == []
    assert checked, "no base has upstream files: nothing was checked"


def test_reinstall_keeps_the_times_of_unchanged_op_sources(tmp_path, monkeypatch):
    """A prefix reinstall must not make ninja rebuild the JIT ops: unchanged op sources keep their mtime, a
    changed one keeps the new one (so a real change is still rebuilt)."""
    import os

    site = tmp_path / "site-packages"
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"purelib": str(site)})
    sources = site / stack.OP_SOURCES
    (sources / "adam").mkdir(parents=True)
    same, changed = sources / "adam" / "cpu_adam.cpp", sources / "adam" / "cpu_adam.h"
    for path in (same, changed):
        path.write_text("// v1\n")
        os.utime(path, ns=(0, 1_000_000_000))
    before = stack._installed_op_sources()

    for path in (same, changed):  # what a reinstall does: new files, new times
        path.unlink()
        path.write_text("// v1\n")
    changed.write_text("// v2\n")
    stack._keep_op_source_times(before)

    assert same.stat().st_mtime_ns == 1_000_000_000
    assert changed.stat().st_mtime_ns > 1_000_000_000

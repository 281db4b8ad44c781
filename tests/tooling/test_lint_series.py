"""Tests of ds_series.lint_series (tooling) on a small synthetic stack: fast, no sdist."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_series import lint_series, stack

PRISTINE = '''import os


def join(a, b):
    return os.path.join(a, b)
'''

# Already off-style and already with a pyflakes finding upstream: not the PR's doing.
PRISTINE_DIRTY = '''def legacy( x ):
    return undefined_upstream + x
'''

SECTIONS = "\n\n## Summary\n\nWhat.\n\n## Changes\n\n- How.\n\n## Testing\n\nRun.\n"


def _commit(repo: Path, files: dict[str, str], message: str, sections: str = SECTIONS) -> None:
    message += sections
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    stack.git(repo, "add", "--all")
    stack.git(repo, "commit", "--quiet", "-m", message)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "tree"
    repo.mkdir()
    stack.git(repo, "init", "--quiet")
    _commit(repo, {"pkg/util.py": PRISTINE, "pkg/legacy.py": PRISTINE_DIRTY, "README.md": "Upstream.\n"}, "pristine")
    stack.git(repo, "tag", stack.UPSTREAM_TAG)
    return repo


def _lint(repo: Path, n: int) -> dict[int, list[lint_series.Finding]]:
    patches = [stack.Patch(k, f"pr-{k}", "", repo) for k in range(1, n + 1)]
    return {p.index: f for p, f in lint_series.lint_tree(repo, patches).items()}


def test_clean_pr_and_preexisting_findings_are_not_reported(repo):
    _commit(
        repo, {
            "pkg/util.py": PRISTINE + "\n\ndef split(path):\n    return os.path.split(path)\n",
            "pkg/legacy.py": PRISTINE_DIRTY + "# a comment\n",
        }, "clean change")
    assert _lint(repo, 1) == {1: []}


def test_each_tool_reports_what_the_pr_adds(repo):
    _commit(repo, {"pkg/util.py": PRISTINE + "\n\ndef fine():\n    return 1\n"}, "PR 1: clean")
    _commit(
        repo, {
            "pkg/util.py": PRISTINE + "\n\ndef fine():\n    return 1\n\n\ndef broken( x ):\n"
            "    return missing_name + x  # recieve\n",
            "pkg/new.py": "import sys\n",
            "README.md": "Upstream.\nWe recieve patches.\n",
        }, "PR 2: lint errors")
    results = _lint(repo, 2)
    assert results[1] == []
    found = {(f.tool, f.path): f.detail for f in results[2]}
    assert "F821 undefined name 'missing_name'" in found[("flake8", "pkg/util.py")]
    assert "line 13" in found[("flake8", "pkg/util.py")]
    assert "def broken( x ):" in found[("yapf", "pkg/util.py")]
    assert found[("codespell", "README.md")].startswith("line 2:")
    assert "F401 'sys' imported but unused" in found[("flake8", "pkg/new.py")]
    assert "recieve ==> receive" in found[("codespell", "README.md")]
    assert found[("codespell", "README.md")].startswith("line 2:")
    assert ("codespell", "pkg/util.py") in found


def test_cli_exits_nonzero_with_a_report(repo, capsys, monkeypatch):
    _commit(repo, {"pkg/util.py": PRISTINE + "print(undefined)\n"}, "PR 1: flake8 error")
    monkeypatch.setattr(stack, "read_series", lambda *a: [stack.Patch(1, "pr-1", "flake8 error", repo)])
    assert lint_series.main(["--tree", str(repo)]) == 1
    out = capsys.readouterr()
    assert "PR 1 (pr-1): 1 new lint finding(s)" in out.out
    assert "F821 undefined name 'undefined'" in out.out
    assert "lint failed" in out.err


def test_the_developers_git_config_changes_nothing(repo, tmp_path, monkeypatch):
    """lint_series runs git with stack.py's isolated configuration: an external diff driver, no prefixes or
    forced colour in the user's global config must not hide or garble a finding."""
    hostile = tmp_path / "gitconfig"
    hostile.write_text('[diff]\n\texternal = sh -c "echo not-a-diff"\n\tnoprefix = true\n[color]\n\tui = always\n')
    _commit(
        repo, {
            "pkg/util.py": PRISTINE + "\n\ndef broken( x ):\n    return missing_name + x\n",
            "README.md": "Upstream.\nWe recieve patches.\n"
        }, "PR 1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(hostile))
    found = {(f.tool, f.path): f.detail for f in _lint(repo, 1)[1]}
    assert "F821 undefined name 'missing_name'" in found[("flake8", "pkg/util.py")]
    assert "def broken( x ):" in found[("yapf", "pkg/util.py")]
    assert found[("codespell", "README.md")].startswith("line 2:")


def test_a_message_without_its_sections_is_reported(repo):
    _commit(repo, {"pkg/util.py": PRISTINE + "\n\ndef fine():\n    return 1\n"},
            "PR 1: sections",
            sections="\n\n## Summary\n\nWhat.\n\n## Changes\n\n- How.\n")
    _commit(repo, {"README.md": "Upstream.\nMore.\n"},
            "PR 2: out of order",
            sections="\n\n## Changes\n\n- How.\n\n## Summary\n\nWhat.\n\n## Testing\n\nRun.\n")
    results = _lint(repo, 2)
    assert [(f.tool, f.detail) for f in results[1]] == [("message", "missing ## Testing")]
    assert [f.tool for f in results[2]] == ["message"] and "out of order" in results[2][0].detail

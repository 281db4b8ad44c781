"""ds_series.hunk_check cuts a PR's diff into hunks and undoes exactly one of them in the file as of the PR."""

import subprocess
from pathlib import Path

import pytest

from ds_series import hunk_check

OLD = "".join(f"line {i}\n" for i in range(1, 41))
NEW = (OLD.replace("line 3\n", "line 3\nadded after 3\n").replace("line 20\n", "changed 20\n").replace(
    "line 35\nline 36\n", ""))


def _diff(tmp_path: Path, old: str | None, new: str, name: str = "deepspeed/mod.py") -> str:
    repo = tmp_path / "repo"
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "empty"], cwd=repo, check=True)
    if old is not None:
        (repo / name).write_text(old)
        subprocess.run([*git, "add", "."], cwd=repo, check=True)
        subprocess.run([*git, "commit", "-q", "-m", "old"], cwd=repo, check=True)
    (repo / name).write_text(new)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "new"], cwd=repo, check=True)
    return hunk_check.git(repo, "diff", "HEAD~1", "HEAD")


def test_each_hunk_undone_alone(tmp_path):
    hunks = hunk_check.parse_diff("pr", _diff(tmp_path, OLD, NEW))
    assert [(h.file, h.index) for h in hunks] == [("deepspeed/mod.py", 1), ("deepspeed/mod.py", 2),
                                                  ("deepspeed/mod.py", 3)]
    undone = [h.reverse(NEW) for h in hunks]
    assert "added after 3" not in undone[0] and "changed 20" in undone[0]
    assert "changed 20" not in undone[1] and "line 20\n" in undone[1] and "added after 3" in undone[1]
    assert "line 35\nline 36\n" in undone[2] and "changed 20" in undone[2]
    text = NEW
    for hunk in reversed(hunks):
        text = hunk.reverse(text)
    assert text == OLD
    assert hunks[1].first_changes() == ["-line 20", "+changed 20"]


def test_a_hunk_that_creates_the_file_deletes_it(tmp_path):
    hunks = hunk_check.parse_diff("pr", _diff(tmp_path, None, "a = 1\n", "deepspeed/new.py"))
    assert len(hunks) == 1 and hunks[0].reverse("a = 1\n") is None


def test_no_newline_at_end_of_file(tmp_path):
    old, new = "a\nb\nc", "a\nb\nc\nd\n"
    hunks = hunk_check.parse_diff("pr", _diff(tmp_path, old, new))
    assert hunks[0].reverse(new) == old


def test_a_hunk_of_comments_and_docstrings_is_no_code_change(tmp_path):
    old = 'def f(x):\n    """Old words."""\n    # old comment\n    return x + 1\n'
    new = 'def f(x):\n    """New words."""\n    # new comment\n    return x + 1\n'
    (hunk, ) = hunk_check.parse_diff("pr", _diff(tmp_path, old, new))
    assert not hunk.code_changed(new)
    changed = new.replace("x + 1", "x + 2")
    (hunk, ) = hunk_check.parse_diff("pr", _diff(tmp_path / "b", old, changed))
    assert hunk.code_changed(changed)


def test_tool_scripts_of_a_checkout(tmp_path):
    # The check runs the checked-out commit's stack.py and build_ops.py as scripts: where they are now, and in
    # tools/ in a commit from before they moved.
    for name in ("stack.py", "build_ops.py"):
        assert hunk_check.tool_script(hunk_check.ROOT, name) == hunk_check.ROOT / "tools" / "ds_series" / name
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "build_ops.py").write_text("")
    assert hunk_check.tool_script(tmp_path, "build_ops.py") == tmp_path / "tools" / "build_ops.py"
    with pytest.raises(SystemExit, match="no tools/ds_series/stack.py"):
        hunk_check.tool_script(tmp_path, "stack.py")

"""The series' naming convention, which the CI prefix runs and the default-behaviour check rely on: the
bug-fix PRs (``fix-*``) lead the tested base's series, so the prefix they form is the release plus bug fixes only."""

import re
from pathlib import Path

from ds_series import stack

ROOT = Path(__file__).resolve().parents[2]


def test_bug_fix_prs_lead_the_series():
    names = [p.name for p in stack.installed_base().series()]
    fixes = [n for n in names if n.startswith("fix-")]
    assert names[:len(fixes)] == fixes, f"every fix-* PR must come before the first other PR: {names}"


def _in_tree_tests(patch: stack.Patch) -> list[str]:
    """The test files of upstream's tree a PR adds or changes: its regression tests, where the fix is to upstream's
    own test harness (0.19.8's fix-cpu-test-harness); ds_series.upstream_tests runs them on the series."""
    text = patch.path.read_text(encoding="utf-8")
    return re.findall(r"^diff --git a/(tests/unit/\S*/test_[^/\s]+\.py) ", text, flags=re.MULTILINE)


def test_every_bug_fix_pr_has_a_regression_test():
    fixes = [p for p in stack.installed_base().series() if p.name.startswith("fix-")]
    marked = {}
    for test_file in (ROOT / "tests").rglob("test_*.py"):
        text = test_file.read_text(encoding="utf-8")
        for name in (p.name for p in fixes):
            if f'pytest.mark.pr("{name}")' in text:
                marked.setdefault(name, []).append(test_file.name)
    missing = [p.name for p in fixes if p.name not in marked and not _in_tree_tests(p)]
    assert not missing, f"bug-fix PRs without a regression test (marked with their name, or in the PR): {missing}"

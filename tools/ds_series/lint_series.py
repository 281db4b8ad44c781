#!/usr/bin/env python3
"""Lint a patch series the way DeepSpeed's pre-commit does (its tools as pinned at v0.19.3, for every base), one PR
at a time.

For every PR K and every file it adds or modifies, compare the file after PR K with the same file
before it (after PR K-1; the pristine sdist for PR 1) and report only what PR K introduces:

- yapf 0.40.0 (pep8 base, 119 columns): reformatting hunks whose lines were not already off-style;
- flake8 5.0.4 (pyflakes and syntax errors only, as DeepSpeed's .flake8 selects): findings whose
  code and message (line numbers aside) are not in the file before;
- codespell: misspellings in the lines the PR adds that are not in the lines it removes.

By default the series of the base (``--base``, as in stack.py) is materialized into a temporary folder;
``--tree`` lints the commits of an existing materialized tree instead (committed work only). Exit status 1
on findings.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ds_series import stack

YAPF_STYLE = "{based_on_style: pep8, column_limit: 119, split_all_comma_separated_values: false}"
FLAKE8_ARGS = ("--isolated", "--ignore=E,F403,F405,F541,F841,W", "--select=E9,F,W6",
               "--per-file-ignores=__init__.py:F401")
CODESPELL_ARGS = ("--ignore-words-list=youn,unsupport,noe,cann", )  # codespell:ignore

_FLAKE8_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<code>\S+) (?P<message>.*)$")
_CODESPELL_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+): (?P<word>.+?) ==> (?P<fix>.*)$")
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(?P<start>\d+)(?:,\d+)? @@")

#: (tool, path in the tree, sha256 of the file) -> findings. A file a PR leaves alone after an earlier PR touched it
#: is linted again as the next PR's "before": the results depend on nothing else, so each version is linted once,
#: by whichever PR's thread asks first (the others wait for its result).
_RESULTS: dict[tuple[str, str, str], Future] = {}
_RESULTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Finding:
    tool: str
    path: str
    detail: str

    def __str__(self) -> str:
        return f"  [{self.tool}] {self.path}: {self.detail}"


def _run(*cmd: str, cwd: Path | None = None) -> str:
    result = subprocess.run([sys.executable, "-m", *cmd],
                            cwd=cwd,
                            text=True,
                            capture_output=True)
    if result.returncode not in (0, 1, 65):  # 1: findings (yapf, flake8), 65: misspellings (codespell)
        raise stack.StackError(f"{' '.join(cmd[:1])} failed ({result.returncode}):\n{result.stderr.strip()}")
    return result.stdout


def _cached(tool: str, rel: str, path: Path, lint) -> list:
    key = (tool, rel, hashlib.sha256(path.read_bytes()).hexdigest())
    with _RESULTS_LOCK:
        future = _RESULTS.get(key)
        ours = future is None
        if ours:
            future = _RESULTS[key] = Future()
    if ours:
        try:
            future.set_result(lint())
        except BaseException as err:
            future.set_exception(err)
    return future.result()


def _show(repo: Path, rev: str, path: str, out_root: Path) -> Path | None:
    """Write ``rev:path`` under ``out_root`` (keeping the relative path); None if it does not exist."""
    result = subprocess.run(stack.git_argv("show", f"{rev}:{path}"),
                            cwd=repo,
                            env=stack.git_env(),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    if result.returncode != 0:
        return None
    dest = out_root / path
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(result.stdout)
    return dest


# -- yapf ---------------------------------------------------------------------------------------


def _yapf_hunks(path: Path | None) -> list[list[str]]:
    """yapf's proposed changes to ``path`` as hunks of diff lines (empty when it is formatted)."""
    if path is None:
        return []

    def lint() -> list[list[str]]:
        hunks: list[list[str]] = []
        for line in _run("yapf", "--diff", "--style", YAPF_STYLE, str(path)).splitlines():
            if line.startswith("@@"):
                hunks.append([line])
            elif hunks and not line.startswith(("---", "+++")):
                hunks[-1].append(line)
        return hunks

    return _cached("yapf", "", path, lint)  # yapf reads no configuration: only the contents count


def yapf_findings(rel: str, before: Path | None, after: Path) -> list[Finding]:
    """Hunks yapf would change in ``after`` that change lines not already off-style in ``before``."""
    allowance = Counter(line[1:] for hunk in _yapf_hunks(before) for line in hunk if line.startswith("-"))
    findings = []
    for hunk in _yapf_hunks(after):
        new = False
        for line in (diff_line[1:] for diff_line in hunk if diff_line.startswith("-")):
            if allowance[line] > 0:
                allowance[line] -= 1
            else:
                new = True
        if new:
            findings.append(
                Finding("yapf", rel, "would reformat:\n" + "\n".join(f"      {diff_line}" for diff_line in hunk)))
    return findings


# -- flake8 -------------------------------------------------------------------------------------


def _flake8(root: Path, rel: str) -> list[tuple[int, str, str]]:

    def lint() -> list[tuple[int, str, str]]:
        found = []
        for line in _run("flake8", *FLAKE8_ARGS, rel, cwd=root).splitlines():
            match = _FLAKE8_LINE.match(line)
            if match:
                found.append((int(match["line"]), match["code"], match["message"]))
        return found

    return _cached("flake8", rel, root / rel, lint)


def flake8_findings(rel: str, before_root: Path | None, after_root: Path) -> list[Finding]:
    """flake8 findings in the file after the PR whose (code, message) the file before did not have."""
    allowance = Counter((c, m) for _, c, m in (_flake8(before_root, rel) if before_root else []))
    findings = []
    for line, code, message in _flake8(after_root, rel):
        if allowance[(code, message)] > 0:
            allowance[(code, message)] -= 1
        else:
            findings.append(Finding("flake8", rel, f"line {line}: {code} {message}"))
    return findings


# -- codespell ----------------------------------------------------------------------------------


def _changed_lines(repo: Path, base: str, head: str, rel: str) -> tuple[list[tuple[int, str]], list[str]]:
    """(line number in head, text) of the lines the change adds, and the texts of the lines it removes."""
    diff = subprocess.run(stack.git_argv("diff", "-U0", "--no-renames", "--no-color", "--no-ext-diff", base, head,
                                         "--", rel),
                          cwd=repo,
                          env=stack.git_env(),
                          text=True,
                          errors="replace",
                          stdout=subprocess.PIPE,
                          check=True).stdout
    added, removed, lineno = [], [], 0
    for line in diff.splitlines():
        hunk = _HUNK.match(line)
        if hunk:
            lineno = int(hunk["start"])
        elif line.startswith("+") and not line.startswith("+++"):
            added.append((lineno, line[1:]))
            lineno += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed.append(line[1:])
    return added, removed


def _misspellings(texts: list[str], workdir: Path) -> list[tuple[int, str]]:
    """(1-based index into ``texts``, codespell's 'word ==> fix') for every misspelling."""
    if not texts:
        return []
    workdir.mkdir(parents=True, exist_ok=True)
    sample = workdir / "lines.txt"
    sample.write_text("\n".join(texts) + "\n", encoding="utf-8")
    found = []
    for line in _run("codespell_lib", *CODESPELL_ARGS, str(sample)).splitlines():
        match = _CODESPELL_LINE.match(line)
        if match:
            found.append((int(match["line"]), f"{match['word']} ==> {match['fix']}"))
    return found


def codespell_findings(repo: Path, base: str, head: str, rel: str, workdir: Path) -> list[Finding]:
    added, removed = _changed_lines(repo, base, head, rel)
    allowance = Counter(word.split(" ==> ")[0] for _, word in _misspellings(removed, workdir / "removed"))
    findings = []
    for index, word in _misspellings([text for _, text in added], workdir / "added"):
        typo = word.split(" ==> ")[0]
        if allowance[typo] > 0:
            allowance[typo] -= 1
        else:
            findings.append(Finding("codespell", rel, f"line {added[index - 1][0]}: {word}"))
    return findings


# -- the commit message ---------------------------------------------------------------------------

#: The sections every PR's message has, in this order (DeepSpeed's PR description: what, why, how tested).
MESSAGE_SECTIONS = ("## Summary", "## Changes", "## Testing")


def message_findings(repo: Path, head: str) -> list[Finding]:
    """A message without its sections: git drops ``## `` lines as comments whenever it opens an editor."""
    message = subprocess.run(stack.git_argv("log", "-1", "--format=%B", head),
                             cwd=repo,
                             env=stack.git_env(),
                             text=True,
                             stdout=subprocess.PIPE,
                             check=True).stdout
    lines = [line.rstrip() for line in message.splitlines()]
    missing = [section for section in MESSAGE_SECTIONS if section not in lines]
    if missing:
        return [Finding("message", "commit message", f"missing {', '.join(missing)}")]
    positions = [lines.index(section) for section in MESSAGE_SECTIONS]
    if positions != sorted(positions):
        return [Finding("message", "commit message", f"sections out of order: want {', '.join(MESSAGE_SECTIONS)}")]
    return []


# -- one PR, the series -------------------------------------------------------------------------


def lint_change(repo: Path, base: str, head: str) -> list[Finding]:
    """Everything the commit range ``base..head`` of ``repo`` adds to DeepSpeed's lint findings."""
    status = subprocess.run(stack.git_argv("diff", "--name-status", "--no-renames", base, head),
                            cwd=repo,
                            env=stack.git_env(),
                            text=True,
                            stdout=subprocess.PIPE,
                            check=True).stdout
    touched = [line.split("\t", 1)[1] for line in status.splitlines() if line[:1] in ("A", "M")]
    findings = message_findings(repo, head)
    with tempfile.TemporaryDirectory(prefix="lint-series-") as tmp:
        before_root, after_root = Path(tmp) / "before", Path(tmp) / "after"
        for index, rel in enumerate(touched):
            findings += codespell_findings(repo, base, head, rel, Path(tmp) / f"codespell-{index}")
            if not rel.endswith(".py"):
                continue
            before = _show(repo, base, rel, before_root)
            after = _show(repo, head, rel, after_root)
            findings += yapf_findings(rel, before, after)
            findings += flake8_findings(rel, before_root if before else None, after_root)
    return findings


def lint_tree(repo: Path, patches: list[stack.Patch]) -> dict[stack.Patch, list[Finding]]:
    """Lint each PR of a materialized tree against the commit before it."""
    commits = stack.stack_commits(repo)
    if len(commits) < len(patches):
        raise stack.StackError(f"{repo} has {len(commits)} commits above '{stack.UPSTREAM_TAG}', "
                               f"fewer than the {len(patches)} PR(s) to lint")
    revs = [stack.UPSTREAM_TAG, *commits]
    # The linters run as subprocesses, mostly yapf on DeepSpeed's large files: one thread per core keeps them busy.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = pool.map(lambda patch: lint_change(repo, revs[patch.index - 1], revs[patch.index]), patches)
        return dict(zip(patches, results))


def report(results: dict[stack.Patch, list[Finding]]) -> bool:
    """Print one block per PR; return True when every PR is clean."""
    clean = True
    for patch, findings in results.items():
        if findings:
            clean = False
            print(f"PR {patch.index} ({patch.name}): {len(findings)} new lint finding(s)")
            for finding in findings:
                print(finding)
        else:
            print(f"PR {patch.index} ({patch.name}): clean")
    return clean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-series-lint", description=__doc__.splitlines()[0])
    parser.add_argument("--base", metavar="VERSION", help="the upstream release whose series to lint (as in stack.py)")
    parser.add_argument("--without-upstream-files",
                        action="store_true",
                        help="as in stack.py: lint without the base's upstream tests/ and docs/ (or the PRs' hunks "
                        "there)")
    parser.add_argument("--upto", type=int, help="lint only the first K PRs")
    parser.add_argument("--tree",
                        type=Path,
                        help="lint the commits of this materialized tree (e.g. deepspeed-src/0.19.3)")
    args = parser.parse_args(argv)
    try:
        base = stack.load_base(args.base) if args.base is not None else stack.default_base()
        if args.without_upstream_files:
            base = dataclasses.replace(base, require_extras=False)
        patches = stack.select(base.series(), args.upto)
        if args.tree is not None:
            results = lint_tree(args.tree, patches)
        else:
            with tempfile.TemporaryDirectory(prefix="lint-series-tree-") as tmp:
                results = lint_tree(stack.materialize(base, Path(tmp) / "tree", args.upto), patches)
    except stack.StackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not report(results):
        print(
            "lint failed: fix the findings above in the PR that introduces them "
            "(git commit --fixup=<pr>, then ds-series-stack export)",
            file=sys.stderr)
        return 1
    print(f"lint passed: {len(patches)} PR(s) add no yapf, flake8 or codespell findings; every message has "
          f"{', '.join(MESSAGE_SECTIONS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

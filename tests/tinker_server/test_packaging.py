"""The server is its own product: installing ``deepspeed-tinker`` installs neither the test harness (``ds_harness``)
nor the patch tooling (``ds_series``); it starts its ranks with ``local_ranks``, which both the server and the tests
use."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.pr("zero-0-1")
SERVER = Path(__file__).resolve().parents[2] / "server"
FORBIDDEN = ("ds_harness", "ds_series")


def _imported_roots(source: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_server_module_imports_the_harness_or_the_tooling() -> None:
    offenders = {str(path.relative_to(SERVER)): sorted(_imported_roots(path) & set(FORBIDDEN))
                 for path in sorted((SERVER / "deepspeed_tinker").rglob("*.py"))}
    assert {path: roots for path, roots in offenders.items() if roots} == {}


def test_the_server_package_depends_on_neither() -> None:
    dependencies = tomllib.loads((SERVER / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "local-ranks" in dependencies
    assert not [d for d in dependencies if d.startswith(("ds-series", "ds_series"))], dependencies


def test_importing_the_server_and_its_launcher_loads_neither() -> None:
    probe = ("import sys, deepspeed_tinker.__main__, deepspeed_tinker.launch, deepspeed_tinker.server; "
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"

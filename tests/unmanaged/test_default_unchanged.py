"""With the flag absent, DeepSpeed computes bitwise what it computes without the unmanaged PRs.

The reference is computed on this machine (``ds_harness.support.pristine``): the pinned sdist plus the series'
bug-fix PRs only, imported from its folder, runs the same fixed managed-mode cases
(``ds_harness.support.reference_run.CASES``) as the installed DeepSpeed. The first session on a machine computes
and caches it; nothing machine-specific is committed.
"""

import pytest

from ds_harness.support.pristine import reference_results
from ds_harness.support.reference_run import CASES, fixed_run

pytestmark = pytest.mark.pr("zero-0-1")

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_results(WORLD_SIZE)


@pytest.mark.world_size(WORLD_SIZE)
@pytest.mark.parametrize("name", list(CASES))
def test_flag_absent_reproduces_deepspeed_without_the_series(dist, name, reference, tmp_path):
    results = dist.run(fixed_run, name, str(tmp_path))
    expected = reference[name]
    if "skipped" in expected[0]:
        pytest.skip(expected[0]["skipped"])
    for rank, (got, want) in enumerate(zip(results, expected)):
        differing = [f"param {p}" for p in want["params"] if got["params"].get(p) != want["params"][p]]
        differing += sorted(key for key in want if key != "params" and got.get(key) != want[key])
        assert not differing, f"rank {rank}: {', '.join(differing)} differ from DeepSpeed without the series"

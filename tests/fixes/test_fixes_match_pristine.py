"""The bug-fix PRs change nothing for a parameter that gets a gradient in every micro-batch.

Each ``fix-*`` PR promises that such a parameter takes exactly the path it took in 0.19.3: the same copies and
additions in the same order. The default-behaviour check (``tests/unmanaged/test_default_unchanged.py``) cannot
see whether that holds: its reference already carries the fixes. Here the reference is pristine 0.19.3, the
pinned sdist with no PR of the series (``ds_harness.support.pristine`` with ``upto=0``), computed on this machine, and
the cases (``ds_harness.support.reference_run.EVERY_GRADIENT_CASES``) are managed-mode runs in which every parameter
gets a gradient in every micro-batch: ZeRO 0-3 in fp32, bf16 and fp16, clipping on and off, GAS 1 and 2, CPU and NVMe
optimizer offload, ZeRO-3 parameter offload, MoE, ``safe_get_full_grad``/``safe_set_full_grad`` between the
boundary backward and ``step()``, the ZeRO optimizer's ``zero_grad()`` between micro-batches. Parameters,
optimizer state, gradient norm, loss scale and the full gradients read must be bitwise equal.

Models with parameters unused in some micro-batches are left out: there the fixes change results on purpose.

The test belongs to the first bug-fix PR, so it runs on every prefix from there on (each fix keeps the promise on
its own), and is marked ``passes_on_pristine``: it is no regression test, ``--regressions-on-pristine`` leaves
it out. The 0.19.8 series carries none of these fixes: it skips there.
"""

import pytest

from ds_harness.support.pristine import reference_results
from ds_harness.support.reference_run import EVERY_GRADIENT_CASES, differences, fixed_run

pytestmark = [
    pytest.mark.pr("fix-zero3-allgather-wait"),
    pytest.mark.passes_on_pristine,
    pytest.mark.base("0.19.3", reason="checks the 0.19.3 series' bug-fix PRs against pristine 0.19.3"),
]

WORLD_SIZE = 2
#: The case table, by its name in ``ds_harness.support.reference_run.TABLES``.
TABLE = "every-gradient"
#: No PR of the series: pristine 0.19.3.
PRISTINE = 0


@pytest.fixture(scope="module")
def pristine() -> dict:
    """Every case's results per rank on pristine 0.19.3 (cached per machine)."""
    return reference_results(WORLD_SIZE, upto=PRISTINE, table=TABLE)


#: Cases a fix PR changes on purpose although every parameter gets a gradient, and where that is tested instead
CHANGED_ON_PURPOSE = {
    "zero2-offload-safe-full-grad": "fix-zero-offload-stale-grads: a value safe_set_full_grad() sets counts in the "
                                    "clipping norm (pristine kept the replaced gradient's); tests/gradient_api/",
    "zero3-offload-safe-full-grad": "fix-zero3-stale-grad-partitions: the same, at ZeRO-3 with optimizer offload",
}


@pytest.mark.world_size(WORLD_SIZE)
@pytest.mark.parametrize("name", [name for name in EVERY_GRADIENT_CASES if name not in CHANGED_ON_PURPOSE])
def test_every_gradient_case_matches_pristine_bitwise(dist, name: str, pristine: dict, tmp_path) -> None:
    results = dist.run(fixed_run, name, str(tmp_path), TABLE)
    expected = pristine[name]
    if "skipped" in expected[0]:
        pytest.skip(expected[0]["skipped"])
    for rank, (got, want) in enumerate(zip(results, expected)):
        differing = differences(got, want)
        assert not differing, f"rank {rank}: {', '.join(differing)} differ from pristine DeepSpeed 0.19.3"

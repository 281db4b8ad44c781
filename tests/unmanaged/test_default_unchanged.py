"""PR 1 and later: with the flag absent, DeepSpeed computes bitwise what pristine 0.19.3 computed.

The fixture was recorded by ``tools/record_reference.py`` from the pristine sdist; rerun that tool only
when the fixed run itself (tests/support/reference_run.py) changes.
"""

import json
from pathlib import Path

import pytest

from support.reference_run import CONFIGS, fixed_run

pytestmark = pytest.mark.pr(1)

FIXTURE = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "default_behaviour.json").read_text())


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_flag_absent_reproduces_pristine_deepspeed(dist, name):
    results = dist.run(fixed_run, name)
    for rank, result in enumerate(results):
        assert result == FIXTURE[f"world_size_{dist.world_size}"][rank][name], f"rank {rank} differs from 0.19.3"

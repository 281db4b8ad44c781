"""Each rank's torch intra-op threads: its share of the cores it may use, overridable (no ranks)."""

from __future__ import annotations

import pytest

from deepspeed_tinker.threads import intra_op_threads, local_ranks

pytestmark = pytest.mark.pr("zero-0-1")


def test_a_rank_takes_its_share_of_the_cores() -> None:
    assert intra_op_threads(None, {"LOCAL_WORLD_SIZE": "2"}, cores=16) == (8, "16 cores / 2 local ranks")
    assert intra_op_threads(None, {"LOCAL_SIZE": "4"}, cores=2) == (1, "2 cores / 4 local ranks"), "at least one"
    assert intra_op_threads(None, {}, cores=6) == (6, "6 cores / 1 local ranks")
    assert local_ranks({"LOCAL_WORLD_SIZE": "3", "LOCAL_SIZE": "2"}) == 3


def test_the_option_and_omp_num_threads_override_it() -> None:
    env = {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "3"}
    assert intra_op_threads(None, env, cores=16) == (3, "OMP_NUM_THREADS")
    assert intra_op_threads(5, env, cores=16) == (5, "--threads-per-rank")

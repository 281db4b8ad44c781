"""Tests of the multi-rank harness itself (tooling). Each runs in seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from ds_harness import RankError, RankTimeout, run_on_ranks
from ds_harness.pools import live_pids
from ds_series import stack

TESTS_DIR = Path(__file__).resolve().parent.parent

# -- bodies (module level: ranks import them by name) ------------------------------------------


def _allreduce_rank_plus_one() -> tuple[int, int, float]:
    t = torch.tensor([float(tdist.get_rank() + 1)])
    tdist.all_reduce(t)
    return tdist.get_rank(), tdist.get_world_size(), t.item()


class Payload:
    """Defined in the test module: crosses the socket by reference in both directions."""

    def __init__(self, rank: int, scale: float) -> None:
        self.rank, self.scale = rank, scale


def _echo(scale: float, payload: Payload, *, offset: int = 0) -> Payload:
    return Payload(tdist.get_rank() + offset, scale * payload.scale)


def _rank_env() -> dict[str, str | bool]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "DS_ACCELERATOR")
    env: dict[str, str | bool] = {k: os.environ.get(k, "") for k in keys}
    env["initialized"] = tdist.is_initialized()
    return env


def _random_draw() -> list[float]:
    return torch.rand(3).tolist()


def _pid() -> int:
    return os.getpid()


def _fail_on_rank1() -> int:
    if tdist.get_rank() == 1:
        print("rank 1 about to divide")
        return 1 // 0
    return tdist.get_rank()


def _fail_on_rank1_while_peers_wait() -> None:
    if tdist.get_rank() == 1:
        raise ValueError("rank 1 gave up before the collective")
    tdist.all_reduce(torch.ones(1))  # rank 0 blocks here forever


def _hang_on_rank1() -> None:
    if tdist.get_rank() == 1:
        while True:
            time.sleep(0.05)


def _die_on_rank1() -> None:
    if tdist.get_rank() == 1:
        os._exit(7)


def _skip_everywhere() -> None:
    pytest.skip("feature not available on this backend")


def _skip_on_rank1() -> None:
    if tdist.get_rank() == 1:
        pytest.skip("only rank 1 lacks it")


def _deepspeed_initialize_step() -> float:
    deepspeed = pytest.importorskip("deepspeed")
    import deepspeed.comm as ds_comm

    assert ds_comm.is_initialized()
    model = torch.nn.Linear(4, 2)
    config = {"train_batch_size": tdist.get_world_size(), "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)
    # Rank-dependent input: the weights agree afterwards only because the gradients were averaged.
    loss = engine(torch.full((1, 4), tdist.get_rank() + 1.0)).sum()
    engine.backward(loss)
    engine.step()
    return float(engine.module.weight.sum())


# -- tests -------------------------------------------------------------------------------------
# Tests that break a pool use torch-only pools (init=TORCH): restarting them costs ~1 s, not the
# ~10 s of importing DeepSpeed on W ranks; the failure handling is the same code.

TORCH = "torch"


@pytest.mark.world_size(1, 2, 4)
def test_allreduce(dist):
    w = dist.world_size
    assert dist.run(_allreduce_rank_plus_one) == [(r, w, w * (w + 1) / 2) for r in range(w)]


@pytest.mark.world_size(2)
def test_results_come_back_per_rank(dist):
    results = dist.run(_echo, 2.0, Payload(-1, 3.0), offset=10)
    assert [(p.rank, p.scale) for p in results] == [(10, 6.0), (11, 6.0)]
    assert all(isinstance(p, Payload) for p in results)


@pytest.mark.world_size(2)
def test_rank_environment(dist):
    cpu = not torch.cuda.is_available()
    for rank, env in enumerate(dist.run(_rank_env)):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["initialized"] is True
        if cpu:
            assert env["DS_ACCELERATOR"] == "cpu"


@pytest.mark.world_size(2)
def test_same_seed_on_every_rank(dist):
    torch.manual_seed(dist.seed)
    expected = torch.rand(3).tolist()
    assert dist.run(_random_draw) == [expected, expected]
    assert dist.run(_random_draw) == [expected, expected]  # reseeded before each run


def test_failure_names_rank_and_shows_its_traceback():
    before = run_on_ranks(_pid, 2, init=TORCH)
    with pytest.raises(RankError) as info:
        run_on_ranks(_fail_on_rank1, 2, init=TORCH)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed: ZeroDivisionError")
    assert "===== rank 1 traceback =====" in message
    assert "in _fail_on_rank1" in message and "return 1 // 0" in message
    assert "rank 1 about to divide" in message  # the rank's output tail
    assert "rank 0 traceback" not in message
    assert info.value.failed_ranks == [1]
    assert set(run_on_ranks(_pid, 2, init=TORCH)).isdisjoint(before), "pool was reused after a failure"


def _fail_on_every_rank() -> int:
    raise AssertionError(f"rank {tdist.get_rank()} checked and failed")


def test_a_pool_whose_every_rank_raised_is_kept_under_regressions_on_pristine(monkeypatch):
    """--regressions-on-pristine keeps a pool whose every rank raised (each left the body); one where only some
    ranks raised is still discarded, as is any pool without the setting."""
    from ds_harness.runner import SETTINGS

    before = run_on_ranks(_pid, 2, init=TORCH)
    with pytest.raises(RankError):
        run_on_ranks(_fail_on_every_rank, 2, init=TORCH)
    assert set(run_on_ranks(_pid, 2, init=TORCH)).isdisjoint(before), "pool kept without the setting"
    monkeypatch.setattr(SETTINGS, "keep_pool_after_every_rank_raised", True)
    before = run_on_ranks(_pid, 2, init=TORCH)
    with pytest.raises(RankError, match=r"^ranks 0, 1 of 2 failed \(first: rank 0\): AssertionError"):
        run_on_ranks(_fail_on_every_rank, 2, init=TORCH)
    assert run_on_ranks(_pid, 2, init=TORCH) == before, "a pool whose every rank raised was not kept"
    with pytest.raises(RankError):
        run_on_ranks(_fail_on_rank1, 2, init=TORCH)
    assert set(run_on_ranks(_pid, 2, init=TORCH)).isdisjoint(before), "pool kept after only one rank failed"


def test_failed_rank_takes_waiting_peers_down():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_fail_on_rank1_while_peers_wait, 2, init=TORCH, timeout=60)
    assert time.monotonic() - t0 < 20, "peers were not killed within the grace period"
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed: ValueError: rank 1 gave up")
    assert "rank 0: killed" in message and "===== rank 0 stacks when killed =====" in message
    assert "_fail_on_rank1_while_peers_wait" in message.split("rank 0 stacks when killed")[1]


def test_dead_rank_is_reported():
    with pytest.raises(RankError, match=r"^rank 1 of 2 failed: rank process died \(exit code 7\)"):
        run_on_ranks(_die_on_rank1, 2, init=TORCH)
    assert live_pids(2, TORCH) == []


@pytest.mark.rank_timeout(2)  # applies to direct run_on_ranks calls too
def test_hang_is_killed_and_next_run_gets_fresh_pool():
    before = run_on_ranks(_pid, 2, init=TORCH)
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_hang_on_rank1, 2, init=TORCH)
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert message.startswith("timed out after 2 s: rank 1 of 2 did not finish")
    stacks = message.split("===== rank 1 stacks when killed =====")[1]
    assert "in _hang_on_rank1" in stacks
    assert live_pids(2, TORCH) == []
    after = run_on_ranks(_pid, 2, init=TORCH)
    assert set(after).isdisjoint(before)


def test_unanimous_skip_skips():
    with pytest.raises(pytest.skip.Exception, match="all 2 ranks skipped: feature not available"):
        run_on_ranks(_skip_everywhere, 2, init=TORCH)
    assert live_pids(2, TORCH), "a unanimous skip must not discard the pool"


def test_disagreeing_skip_fails_naming_ranks():
    with pytest.raises(RankError,
                       match=r"skips disagree: rank 1 of 2 skipped \('only rank 1 lacks it'\) "
                       r"but rank 0 did not"):
        run_on_ranks(_skip_on_rank1, 2, init=TORCH)


def test_bodies_must_be_importable():
    with pytest.raises(TypeError, match="module-level"):
        run_on_ranks(lambda: 0, 1, init=TORCH)
    with pytest.raises(TypeError, match="not picklable"):
        run_on_ranks(_echo, 1, lambda: 0, init=TORCH)


@pytest.mark.world_size(2)
def test_deepspeed_finds_group_initialised(dist):
    weights = dist.run(_deepspeed_initialize_step)
    assert weights[0] == weights[1]


def test_pytest_integration(tmp_path):
    """End to end in a child pytest: markers, --upto, --world-sizes, failure and skip reports."""
    shutil.copy(TESTS_DIR / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent("""
        import pytest
        import torch.distributed as tdist

        def _rank():
            return tdist.get_rank()

        def _boom():
            if tdist.get_rank() == 1:
                raise KeyError("only on rank one")

        def _skip():
            pytest.skip("not here")

        @pytest.mark.world_size(1, 2, 4)
        def test_ranks(dist):
            assert dist.run(_rank) == list(range(dist.world_size))

        @pytest.mark.pr("feature-a")
        @pytest.mark.world_size(2)
        def test_boom(dist):
            dist.run(_boom)

        @pytest.mark.pr("feature-b")
        def test_skip(dist):
            dist.run(_skip)

        @pytest.mark.pr("feature-c")
        def test_later_pr():
            pass
    """))
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "--upto", "3", "--world-sizes", "1,2",
        str(tmp_path)
    ]
    env = dict(os.environ, DS_HARNESS_INIT="torch", DS_SERIES_FILE=str(_sample_series(tmp_path)))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed, 1 skipped, 2 deselected" in out, out
    assert "rank 1 of 2 failed: KeyError: 'only on rank one'" in out
    assert "===== rank 1 traceback =====" in out and "in _boom" in out
    assert "all 2 ranks skipped: not here" in out
    assert "PytestUnknownMarkWarning" not in out


def _sample_series(folder):
    series = folder / "series"
    series.write_text("# sample\nfix-thing Fix a thing\nfeature-a A\nfeature-b B\nfeature-c C\n")
    return series


def _child_pytest(folder, *args, installed_version=None):
    """A child pytest with the repository's conftest (the installed harness), the sample series and, optionally, a
    stand-in distribution metadata so that ``deepspeed`` looks installed at ``installed_version``."""
    shutil.copy(TESTS_DIR / "conftest.py", folder / "conftest.py")
    if installed_version is not None:
        info = folder / f"deepspeed-{installed_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {installed_version}\n")
    env = dict(os.environ, DS_HARNESS_INIT="torch", DS_SERIES_FILE=str(_sample_series(folder)))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rxXs", *args, str(folder)]
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


REGRESSION_SAMPLE = textwrap.dedent("""
    import pytest

    @pytest.mark.pr("fix-thing")
    def test_regression_fails_without_the_fix():
        assert {fails}

    @pytest.mark.pr("feature-a")
    def test_feature():
        assert False, "not selected on pristine"

    def test_tooling():
        assert False, "not selected on pristine"
""")


def test_regressions_on_pristine_select_fix_prs_as_strict_xfail(tmp_path):
    (tmp_path / "test_sample.py").write_text(REGRESSION_SAMPLE.format(fails="False"))
    rc, out = _child_pytest(tmp_path, "--regressions-on-pristine", installed_version="0.19.3+unmanagedga.0")
    assert rc == 0, out
    assert "2 deselected, 1 xfailed" in out, out
    assert "regression tests of fix-thing, expected to fail" in out, out


def test_regressions_on_pristine_fail_when_a_regression_test_passes(tmp_path):
    (tmp_path / "test_sample.py").write_text(REGRESSION_SAMPLE.format(fails="True"))
    rc, out = _child_pytest(tmp_path, "--regressions-on-pristine", installed_version="0.19.3")
    assert rc == 1, out
    assert "1 failed, 2 deselected" in out and "XPASS(strict)" in out, out


def test_regressions_on_pristine_refuse_a_patched_deepspeed(tmp_path):
    (tmp_path / "test_sample.py").write_text(REGRESSION_SAMPLE.format(fails="False"))
    rc, out = _child_pytest(tmp_path, "--regressions-on-pristine", installed_version="0.19.3+unmanagedga.4")
    assert rc != 0 and "needs DeepSpeed without the series" in out and "0.19.3+unmanagedga.4" in out, out


def test_regressions_on_pristine_leave_out_what_passes_on_pristine(tmp_path):
    """A test of a fix-* PR marked passes_on_pristine (what the fix leaves unchanged) is no regression test: not
    run as a strict xfail on pristine, run as usual on the series. Marked passes_on_pristine for other bases only,
    it is a regression test here."""
    pristine, series = tmp_path / "pristine", tmp_path / "series"
    for folder in (pristine, series):
        folder.mkdir()
        (folder / "test_sample.py").write_text(
            REGRESSION_SAMPLE.format(fails="False") + textwrap.dedent("""
            @pytest.mark.pr("fix-thing")
            @pytest.mark.passes_on_pristine
            def test_unchanged_by_the_fix():
                pass

            @pytest.mark.pr("fix-thing")
            @pytest.mark.passes_on_pristine("0.0.1")
            def test_passes_on_the_pristine_of_another_base_only():
                assert False
        """))
    rc, out = _child_pytest(pristine, "--regressions-on-pristine", installed_version="0.19.3+unmanagedga.0")
    assert rc == 0 and "3 deselected, 2 xfailed" in out, out
    rc, out = _child_pytest(series, "--upto", "fix-thing", "-k", "unchanged")
    assert rc == 0 and "1 passed, 4 deselected" in out, out
    assert "PytestUnknownMarkWarning" not in out, out


def test_pr_markers_name_prs_of_the_series(tmp_path):
    old, named = tmp_path / "old", tmp_path / "named"
    old.mkdir()
    named.mkdir()
    (old / "test_sample.py").write_text("import pytest\n\n@pytest.mark.pr(2)\ndef test_old():\n    pass\n")
    rc, out = _child_pytest(old)
    assert rc != 0 and "use @pytest.mark.pr(name, ...) with short names from a series index" in out, out
    (named / "test_sample.py").write_text(REGRESSION_SAMPLE.format(fails="True"))
    rc, out = _child_pytest(named, "--upto", "feature-a", "-k", "regression or feature")
    assert rc == 1 and "1 failed, 1 passed, 1 deselected" in out, out


BASES_SAMPLE = textwrap.dedent("""
    import pytest

    @pytest.mark.pr("feature-a", "zero-2")
    def test_promise_of_both_series():
        pass

    @pytest.mark.pr("zero-2")
    def test_promise_named_by_the_other_series_only():
        pass

    @pytest.mark.pr("fix-zero3-allgather-wait")
    def test_regression_of_a_fix_this_series_lacks():
        pass

    @pytest.mark.base("0.0.1")
    @pytest.mark.pr("feature-a")
    def test_internals_of_another_series():
        pass
""")


def test_pr_markers_across_bases(tmp_path):
    """A test names the PR of each series that makes its promise; a name only another series has puts it at
    the end of this one; another series' fixes and internals are skipped here, saying why."""
    first, second = tmp_path / "all", tmp_path / "upto"
    for folder in (first, second):
        folder.mkdir()
        (folder / "test_sample.py").write_text(BASES_SAMPLE)
    rc, out = _child_pytest(first, "-v")
    assert rc == 0 and "2 passed, 2 skipped" in out, out
    # The child's base is the installed DeepSpeed's (the sample series names none of its PRs).
    assert f"a bug fix the {stack.installed_base().version} series does not carry" in out, out
    assert "tests the 0.0.1 series' internals" in out, out
    rc, out = _child_pytest(second, "--upto", "feature-a", "-k", "promise", "-v")
    assert rc == 0 and "1 passed, 3 deselected" in out, out
    assert "test_promise_of_both_series PASSED" in out, out


def test_core_paths_name_real_configurations_of_every_stage_and_offload_mode():
    """``--paths core`` keeps ds_harness.support.paths.CORE_PATHS: a misspelt name would silently drop a
    configuration."""
    from ds_harness.support.paths import CORE_PATHS, PATHS

    assert CORE_PATHS <= set(PATHS), sorted(CORE_PATHS - set(PATHS))
    assert {PATHS[name].stage for name in CORE_PATHS} == {0, 1, 2, 3}
    for kind in ("offload", "nvme", "offload-param", "fp16", "bf16"):
        assert any(kind in name for name in CORE_PATHS), kind

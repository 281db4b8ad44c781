"""tinker-cookbook's RL loop against the server (the RL demo's client, a few steps, on ZeRO 3).

tinker-cookbook is installed with ``--no-deps`` (requirements/tinker-cookbook.txt says why), so an
environment built from the other requirement files alone may lack it: these tests skip there. The
RL demo (the README's demo command, run in CI) trains the same task to a rising reward.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tinker_sdk_helpers import require

require("tinker")
pytest.importorskip("tinker_cookbook.rl.train", reason="install requirements/tinker-cookbook.txt (--no-deps)")

from tinker_sdk_helpers import API_KEY, load_example  # noqa: E402

rl_client = load_example("rl_client")

pytestmark = pytest.mark.pr("zero-0-1")


def test_the_task_rewards_lowercase_letters_and_the_cookbook_gets_the_byte_tokenizer(tmp_path: Path) -> None:
    assert rl_client.reward(list(b"abcdefgh")) == 1.0
    assert rl_client.reward(list(b"aB3 x\x00\xffz")) == 3 / 8
    rl_client.make_config("http://127.0.0.1:1", tmp_path / "log", steps=1)  # registers the tokenizer
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    tokenizer = get_tokenizer(rl_client.BASE_MODEL)  # from the registry: nothing downloaded
    assert tokenizer.encode("letters:", add_special_tokens=False) == list(b"letters:")
    assert tokenizer.decode(list(b"hi there")) == "hi there"


def test_the_cookbook_rl_loop_trains_against_the_server(server, tmp_path: Path, root_logging,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if server.zero_stage != 3:
        pytest.skip("one stage is enough here: the RL demo runs the same loop on ZeRO 1")
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)  # the key the tests' servers accept (the client reads it there)
    log_dir = tmp_path / "cookbook-log"
    config = rl_client.make_config(server.base_url, log_dir, steps=3)
    asyncio.run(rl_client.train.main(config))
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert trained, "no step trained"
    for row in trained:  # sampling from the snapshot, then N forward_backward requests and one optim_step
        assert 0.0 <= row["env/all/reward/total"] <= 1.0
        assert row["fwdbwd_requests:sum"] >= 2 and row["optim_steps:max"] >= 1
    checkpoints = [json.loads(line) for line in (log_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert checkpoints[-1]["sampler_path"].endswith("/sampler_weights/final")

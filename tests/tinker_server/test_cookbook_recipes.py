"""tinker-cookbook's ready-made entry points, unmodified, against the server: ``recipes/sl_basic`` (the cookbook's
``supervised/train`` with the ``qwen3`` renderer) on ``Qwen/Qwen3-8B`` and ``recipes/rl_basic`` (``rl/train`` with
``async_config``, so ``stable_reinforce`` on samples recorded with ``record_stability_info``, and the
``role_colon`` renderer) on ``meta-llama/Llama-3.1-8B``, both names served from the session's tiny ``chat_models``.

Each is driven through the recipe's own ``build_config_blueprint`` and ``main``, with what a user changes on its
command line (``base_url``, ``log_path``, the learning rate, a few steps) and a local dataset in place of the one
it downloads from the hub: the cookbook's own ``example_data/conversations.jsonl`` for SL, the letters task as a
chat (``examples/tinker_server/chat_letters.py``) for RL. The tokenizers come from the cookbook's registry
(``register_tokenizer``, as a user's script does offline). One ZeRO stage each: ~10 s and ~20-80 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinker_sdk_helpers import API_KEY, require

require("tinker")
pytest.importorskip("tinker_cookbook.rl.train", reason="install requirements/tinker-cookbook.txt (--no-deps)")

pytestmark = pytest.mark.pr("zero-0-1")
QWEN, LLAMA = "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B"


@pytest.fixture
def cookbook_env(chat_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, root_logging: None) -> None:
    """Offline, the API key set, the chat models' tokenizers registered under their names."""
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    for name, path in chat_models.items():
        tokenizer_utils.register_tokenizer(name, lambda path=path: AutoTokenizer.from_pretrained(str(path)))


def metrics(log_path: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row[key] for row in rows if key in row]


def test_sl_basic_lowers_the_loss(server, cookbook_env, tmp_path: Path) -> None:
    if server.zero_stage != 1:
        pytest.skip("one stage is enough: the recipe's requests are those the SDK tests check on every stage")
    import tinker_cookbook
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=QWEN, renderer_name="qwen3", max_length=192,
                                            batch_size=8, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    log_path = tmp_path / "sl_basic"
    config = sl_basic.build_config_blueprint(QWEN).apply({
        "dataset_builder": FromConversationFileBuilder(common_config=common, file_path=str(conversations)),
        "base_url": server.base_url, "log_path": str(log_path), "learning_rate": 2e-2, "lora_rank": 8,
        "max_steps": 8, "eval_every": 0, "save_every": 0}).make()
    assert config.renderer_name == "qwen3" and config.model_name == QWEN
    sl_basic.main(config)
    nll = metrics(log_path, "train_mean_nll")
    assert len(nll) == 8
    assert sum(nll[-2:]) / 2 < sum(nll[:2]) / 2 - 0.5, f"the loss did not go down: {nll}"


def test_rl_basic_with_async_config_raises_the_reward(server, cookbook_env, tmp_path: Path) -> None:
    if server.zero_stage != 3:
        pytest.skip("one stage is enough: the recipe's requests are those the SDK tests check on every stage")
    from tinker_cookbook.recipes import rl_basic
    from tinker_cookbook.rl.train import AsyncConfig

    from examples.tinker_server.chat_letters import ChatLettersDatasetBuilder

    log_path = tmp_path / "rl_basic"
    config = rl_basic.build_config_blueprint(LLAMA).apply({
        "dataset_builder": ChatLettersDatasetBuilder(renderer_name="role_colon", model_name_for_tokenizer=LLAMA,
                                                     batches=14, batch_size=4, group_size=8, max_tokens=8),
        "base_url": server.base_url, "log_path": str(log_path), "learning_rate": 3e-2, "lora_rank": 16,
        "max_tokens": 8, "async_config": AsyncConfig(max_steps_off_policy=1, groups_per_batch=4),
        "num_groups_to_log": 0, "rollout_json_export": False, "save_every": 0}).make()
    assert config.renderer_name == "role_colon" and config.training_loss_fn() == "stable_reinforce"
    rl_basic.main(config)
    rewards = metrics(log_path, "env/all/reward/total")
    assert len(rewards) >= 12
    # Sampling runs beside training (async_config), so the curve is noisy: 14 steps and a margin that a run seen
    # to learn slowly (0.11 -> 0.17 over the first and last three of 10 steps) still clears
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, f"the reward did not rise: {rewards}"

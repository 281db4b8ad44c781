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
import math
from pathlib import Path

import numpy as np
import pytest

from tinker_sdk_helpers import API_KEY, require

require("tinker")
pytest.importorskip("tinker_cookbook.rl.train", reason="install requirements/tinker-cookbook.txt (--no-deps)")

pytestmark = pytest.mark.pr("zero-0-1")
QWEN, LLAMA = "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B"
#: The replays' tolerance on trained weights: see test_sdk_e2e.py (fp32 on both sides, summation order only).
WEIGHT_ATOL = 2e-5


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


# --- DPO ------------------------------------------------------------------------------------------------------------

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "light", "green", "quiet", "bread", "north"]


def write_comparisons(path: Path, count: int) -> Path:
    """A local preference file in the format of the cookbook's ``ComparisonBuilderFromJsonl`` (its
    ``LabeledComparison`` rows): the same words answered in lowercase (preferred) and in uppercase."""
    rows = []
    for i in range(count):
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3))
        convo = [{"role": "user", "content": f"Say three words ({i})."}]
        lower, upper = [{"role": "assistant", "content": words}], [{"role": "assistant", "content": words.upper()}]
        label = "A" if i % 2 == 0 else "B"  # the preferred answer on either side
        rows.append({"comparison": {"prompt_conversation": convo, "completion_A": lower if label == "A" else upper,
                                    "completion_B": upper if label == "A" else lower}, "label": label})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def replay_dpo(model_path: Path, lora: "LoraSpec", batches: list[list], learning_rates: list[float], beta: float,
               adam: dict[str, float]) -> tuple[list[float], dict]:
    """``train_dpo``'s steps in plain PyTorch, from the DPO paper's formula: per pair
    ``-log sigmoid(beta * ((chosen - chosen_ref) - (rejected - rejected_ref)))``, the mean over the batch's pairs,
    each sequence's log-probability the weighted sum of its tokens', the reference the initial weights; one AdamW
    step per batch. Returns each step's loss and the trained adapters."""
    import copy

    import torch

    from examples.tinker_server.model import token_logprobs
    from tinker_sdk_helpers import PlainReplay

    replay = PlainReplay(str(model_path), lora)
    reference = copy.deepcopy(replay.model).eval()
    losses = []

    def sequence_logprob(model, datum) -> "torch.Tensor":
        tokens = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor([datum.loss_fn_inputs["target_tokens"].data])
        weights = torch.tensor(datum.loss_fn_inputs["weights"].data, dtype=torch.float32)
        return (token_logprobs(model, tokens, targets)[0] * weights).sum()

    for batch, lr in zip(batches, learning_rates):
        with torch.no_grad():
            ref = [sequence_logprob(reference, datum) for datum in batch]
        policy = [sequence_logprob(replay.model, datum) for datum in batch]
        pairs = [(policy[i] - ref[i]) - (policy[i + 1] - ref[i + 1]) for i in range(0, len(batch), 2)]
        loss = torch.stack([-torch.nn.functional.logsigmoid(beta * d) for d in pairs]).mean()
        loss.backward()
        replay.optim_step({**adam, "learning_rate": lr})
        losses.append(float(loss.detach()))
    return losses, replay.state_dict()


def test_dpo_lowers_the_loss_and_equals_a_plain_pytorch_replay(server, cookbook_env, tmp_path: Path) -> None:
    """``preference/train_dpo.main`` (the entry point of ``recipes/preference/dpo``) on a local preference file:
    the reference is a sampler snapshot of the initial weights, the loss a ``forward_backward_custom``; the DPO loss
    falls, the preference accuracy rises, and every step's loss and the final adapters equal a plain-PyTorch replay.
    The run starts from a saved LoRA checkpoint (``load_checkpoint_path``, a recipe option) so the replay knows the
    initial adapters."""
    if server.zero_stage != 2:
        pytest.skip("one stage is enough: the recipe's requests are those the SDK tests check on every stage")
    import tinker
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    from examples.tinker_server.model import LoraSpec, register_local_model
    from tinker_sdk_helpers import max_weight_difference, saved_weights

    service = tinker.ServiceClient(base_url=server.base_url)
    lora = LoraSpec(rank=32, seed=25)
    initial = service.create_lora_training_client(base_model=QWEN, rank=lora.rank, seed=lora.seed).result()
    start = initial.save_state("dpo-initial").result().path

    beta, lr, steps = 0.1, 1e-2, 6  # the recipe's beta
    builder = DPODatasetBuilderFromComparisons(
        common_config=ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=QWEN, renderer_name="qwen3",
                                                     max_length=128, batch_size=4),
        comparison_builder=ComparisonBuilderFromJsonl(train_path=str(write_comparisons(tmp_path / "prefs.jsonl",
                                                                                        4 * steps))))
    log_path = tmp_path / "dpo"
    config = train_dpo.Config(log_path=str(log_path), model_name=QWEN, recipe_name="recipe_preference_dpo",
                              renderer_name="qwen3", dataset_builder=builder, load_checkpoint_path=start,
                              learning_rate=lr, dpo_beta=beta, base_url=server.base_url, save_every=0, eval_every=0,
                              infrequent_eval_every=0)
    train_dpo.main(config)

    loss, accuracy = metrics(log_path, "dpo_loss"), metrics(log_path, "accuracy")
    assert len(loss) == steps and all(math.isfinite(x) for x in loss)
    assert abs(loss[0] - math.log(2)) < 1e-3, "the first step's policy is its reference"
    assert sum(loss[-2:]) / 2 < loss[0] - 0.2, f"the DPO loss did not fall: {loss}"
    assert sum(accuracy[-2:]) / 2 > 0.9, f"the preference accuracy did not rise: {accuracy}"

    # The same steps in plain PyTorch: the cookbook's own batches (its shuffle), its linear learning-rate decay
    dataset, _ = builder()
    dataset.set_epoch(seed=0)
    register_local_model(str(server.chat_models[QWEN]))
    expected, weights = replay_dpo(server.chat_models[QWEN], lora, [dataset.get_batch(i) for i in range(steps)],
                                   [lr * (1 - step / steps) for step in range(steps)], beta,
                                   {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
                                    "grad_clip_norm": 0.0})
    np.testing.assert_allclose(loss, expected, atol=1e-4)
    final = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])["state_path"]
    difference = max_weight_difference(saved_weights(server.checkpoint_dir, final), weights)
    moved = max_weight_difference(saved_weights(server.checkpoint_dir, start), weights)
    assert difference < WEIGHT_ATOL, f"the adapters differ from the replay by {difference}"
    assert moved > 100 * WEIGHT_ATOL, f"training barely moved the adapters ({moved}): the comparison says nothing"

"""``serve --sampler vllm`` through the SDK: every Tinker sampling parameter on vLLM, LoRA snapshots as vLLM adapters
(an older sampling client keeps its weights; an adapter that left vLLM is registered again from disk), full
fine-tuning refused with the alternative named, vLLM's logprobs against the trainer's, and tinker-cookbook's RL recipe
unmodified.

vLLM runs from its own environment (tools/vllm-env.sh; tools/test.sh exports ``DEEPSPEED_TINKER_VLLM_PYTHON``);
without one these tests skip. One 2-rank ZeRO-1 server with vLLM serves the module (vLLM starts in 20-60 s here). The
model is a tiny Qwen3 of hidden size 64: vLLM's CPU attention has no kernel for the smaller heads of the other tests'
tiny models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from tinker_sdk_helpers import API_KEY, VLLM_PYTHON, load_example, require, requires_vllm, served

require("tinker")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.pr("zero-0-1"), requires_vllm]
QWEN = "Qwen/Qwen3-8B"
#: vLLM's logprobs against the trainer's forward, fp32 on both sides: kernel rounding only, never bitwise (other
#: kernels; measured: at most 9.5e-7 over 4,096 tokens), so ten times that.
LOGPROB_ATOL = 1e-5
#: Adapters registered with vLLM at once: small, so the tests see one leave and come back.
ADAPTERS = 2
MAX_LORA_RANK = 16


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deepspeed_tinker.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "qwen3-h64", "qwen3", hidden_size=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, qwen_dir: Path) -> Iterator[Any]:
    args = ("--sampler", "vllm", "--vllm-python", VLLM_PYTHON, "--vllm-adapters", str(ADAPTERS),
            "--vllm-max-lora-rank", str(MAX_LORA_RANK))
    with served(tmp_path_factory.mktemp("vllm-server"), 1, base_models=(f"{QWEN}={qwen_dir}", ),
                extra_args=args) as server:
        yield server


@pytest.fixture(scope="module")
def service(server: Any) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)


@pytest.fixture(scope="module")
def tokenizer(qwen_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir))


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def train(training: tinker.TrainingClient, steps: int, tokens: list[int] | None = None) -> None:
    for _ in range(steps):
        training.forward_backward([datum(tokens or [5, 6, 7, 8, 9, 10, 11])], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def sample(client: tinker.SamplingClient, prompt: list[int], **params: Any) -> types.SampleResponse:
    options = {k: params.pop(k) for k in ("num_samples", "include_prompt_logprobs", "topk_prompt_logprobs",
                                          "topk_sample_logprobs", "prompt_logprobs_last_n") if k in params}
    return client.sample(types.ModelInput.from_ints(prompt), sampling_params=types.SamplingParams(**params),
                         **{"num_samples": 1, **options}).result()


def greedy(client: tinker.SamplingClient, prompt: list[int], max_tokens: int = 8) -> list[int]:
    return list(sample(client, prompt, max_tokens=max_tokens, temperature=0.0, stop=[]).sequences[0].tokens)


def trainer_logprobs(training: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    """The trainer's forward: ``log p(tokens[i] | tokens[:i])`` for i >= 1."""
    out = training.forward([datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())


#: A sequence the snapshot tests train on and read back: which weights a sampler holds shows in its logprobs of it.
PROBE = [9, 8, 7, 6, 5, 4, 3]


def probe_logprobs(client: tinker.SamplingClient) -> np.ndarray:
    """The sampler's ``log p(PROBE[i] | PROBE[:i])``, i >= 1: its weights, seen without a draw (a tiny model's greedy
    tokens can stay the same across training steps)."""
    result = sample(client, PROBE, max_tokens=1, stop=[], include_prompt_logprobs=True)
    return np.asarray(result.prompt_logprobs[1:])


def close(sampler: np.ndarray, trainer: np.ndarray) -> bool:
    return bool(np.allclose(sampler, trainer, atol=LOGPROB_ATOL, rtol=0))


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient) -> tuple[tinker.TrainingClient, tinker.SamplingClient]:
    training = service.create_lora_training_client(base_model=QWEN, rank=8).result(timeout=120)
    train(training, 3)
    return training, training.save_weights_and_get_sampling_client().result(timeout=120)


PROMPT = [3, 17, 42, 8]


def test_max_tokens_num_samples_and_seed(trained) -> None:
    _, client = trained
    first = sample(client, PROMPT, max_tokens=6, temperature=1.0, seed=11, stop=[], num_samples=3)
    again = sample(client, PROMPT, max_tokens=6, temperature=1.0, seed=11, stop=[], num_samples=3)
    other = sample(client, PROMPT, max_tokens=6, temperature=1.0, seed=12, stop=[], num_samples=3)
    assert len(first.sequences) == 3
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in first.sequences)
    tokens = [list(s.tokens) for s in first.sequences]
    assert tokens == [list(s.tokens) for s in again.sequences]  # the seed decides
    assert tokens != [list(s.tokens) for s in other.sequences]
    assert len({tuple(t) for t in tokens}) > 1  # each sample its own draw


def test_greedy_top_k_1_and_a_tiny_top_p_pick_the_most_likely_token(trained) -> None:
    _, client = trained
    reference = sample(client, PROMPT, max_tokens=6, temperature=0.0, stop=[], topk_sample_logprobs=1)
    sequence = reference.sequences[0]
    assert list(sequence.tokens) == [row[0][0] for row in sequence.topk_logprobs]  # each token the argmax
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        drawn = sample(client, PROMPT, max_tokens=6, temperature=1.0, seed=3, stop=[], **params)
        assert list(drawn.sequences[0].tokens) == list(sequence.tokens), params


def test_top_k_restricts_the_draw(trained) -> None:
    _, client = trained
    result = sample(client, PROMPT, max_tokens=5, temperature=1.0, top_k=3, seed=5, stop=[], num_samples=4,
                    topk_sample_logprobs=3)
    for sequence in result.sequences:
        for token, row in zip(sequence.tokens, sequence.topk_logprobs):
            assert token in [t for t, _ in row], (token, row)


@pytest.fixture(scope="module")
def base_client(service: tinker.ServiceClient) -> tinker.SamplingClient:
    """The untrained model: close to uniform over the vocabulary, so a draw holds printable text and the EOS."""
    return service.create_sampling_client(base_model=QWEN).result(timeout=120)


def test_stop_tokens_and_stop_strings(base_client, tokenizer) -> None:
    client = base_client
    draw = {"max_tokens": 16, "temperature": 1.0, "seed": 21}  # a stop only cuts the same draw short
    tokens = list(sample(client, PROMPT, stop=[], **draw).sequences[0].tokens)
    stop_token = tokens[3]
    result = sample(client, PROMPT, stop=[stop_token], **draw)
    assert list(result.sequences[0].tokens) == tokens[:tokens.index(stop_token) + 1]
    assert result.sequences[0].stop_reason == "stop"
    # A stop string: the text of a later printable token; the completion ends with the token that completes it.
    text = next(tokenizer.decode([t]) for t in tokens[1:] if tokenizer.decode([t]).strip().isprintable()
                and tokenizer.decode([t]).strip())
    end = next(i for i in range(1, len(tokens) + 1) if text in tokenizer.decode(tokens[:i]))
    result = sample(client, PROMPT, stop=[text], **draw)
    assert list(result.sequences[0].tokens) == tokens[:end] and result.sequences[0].stop_reason == "stop"


def test_the_models_eos_stops_unless_stop_is_empty(base_client, qwen_dir: Path) -> None:
    import json

    client = base_client
    eos = json.loads((qwen_dir / "config.json").read_text())["eos_token_id"]
    draw = {"max_tokens": 60, "temperature": 1.0, "seed": 1, "num_samples": 32}
    free = [list(s.tokens) for s in sample(client, PROMPT, stop=[], **draw).sequences]
    assert all(len(t) == 60 for t in free)  # no stop at all: every completion runs to max_tokens
    assert any(eos in t for t in free), "no draw sampled the EOS: pick another seed"
    # The same draws with the default stop: each ends at its first EOS (kept), the others run on.
    stopped = sample(client, PROMPT, **draw).sequences
    for tokens, s in zip(free, stopped):
        cut = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
        assert list(s.tokens) == cut and s.stop_reason == ("stop" if eos in tokens else "length")


def test_a_sampler_checkpoint_saved_again_under_its_name_samples_the_new_weights(service) -> None:
    training = service.create_lora_training_client(base_model=QWEN, rank=8).result(timeout=120)
    train(training, 2)
    path = training.save_weights_for_sampler("latest").result(timeout=120).path
    before = probe_logprobs(service.create_sampling_client(model_path=path).result(timeout=120))
    assert close(before, trainer_logprobs(training, PROBE))
    train(training, 3, PROBE)
    assert training.save_weights_for_sampler("latest").result(timeout=120).path == path
    after = probe_logprobs(service.create_sampling_client(model_path=path).result(timeout=120))
    expected = trainer_logprobs(training, PROBE)
    assert close(after, expected)
    assert np.abs(before - expected).max() > 1e-2  # training moved the weights: "after" is not the old adapter


def test_logprobs_and_prompt_logprobs_match_the_trainer(trained) -> None:
    training, client = trained
    result = sample(client, PROMPT, max_tokens=6, temperature=1.0, seed=9, stop=[], include_prompt_logprobs=True,
                    topk_prompt_logprobs=3)
    sequence = result.sequences[0]
    expected = trainer_logprobs(training, PROMPT + list(sequence.tokens))
    assert np.allclose(sequence.logprobs, expected[len(PROMPT) - 1:], atol=LOGPROB_ATOL, rtol=0)
    assert result.prompt_logprobs[0] is None
    assert np.allclose(result.prompt_logprobs[1:], expected[:len(PROMPT) - 1], atol=LOGPROB_ATOL, rtol=0)
    rows = result.topk_prompt_logprobs
    assert rows[0] is None and all(len(row) == 3 for row in rows[1:])
    for row, own in zip(rows[1:], result.prompt_logprobs[1:]):
        values = [v for _, v in row]
        assert values == sorted(values, reverse=True) and values[0] >= own - LOGPROB_ATOL
    last = sample(client, PROMPT, max_tokens=1, include_prompt_logprobs=True, prompt_logprobs_last_n=2)
    assert last.prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert np.allclose(last.prompt_logprobs[-2:], expected[len(PROMPT) - 3:len(PROMPT) - 1], atol=LOGPROB_ATOL, rtol=0)


def test_an_older_sampling_client_keeps_its_weights_and_an_adapter_comes_back_from_disk(service) -> None:
    training = service.create_lora_training_client(base_model=QWEN, rank=8).result(timeout=120)
    train(training, 2)
    old = training.save_weights_and_get_sampling_client().result(timeout=120)
    old_weights = trainer_logprobs(training, PROBE)
    first_reading = probe_logprobs(old)
    assert close(first_reading, old_weights)
    snapshots = []
    for _ in range(ADAPTERS + 1):  # more snapshots than vLLM holds: the first one's adapter leaves vLLM
        train(training, 2, PROBE)
        snapshots.append(training.save_weights_and_get_sampling_client().result(timeout=120))
        probe_logprobs(snapshots[-1])
    new_weights = trainer_logprobs(training, PROBE)
    assert np.abs(new_weights - old_weights).max() > 1e-2  # training moved the weights
    assert close(probe_logprobs(snapshots[-1]), new_weights)
    # The old client's weights, registered again from disk: the trainer's then, and bit for bit its first reading
    # (the same adapter file through the same kernels).
    again = probe_logprobs(old)
    assert close(again, old_weights) and np.array_equal(again, first_reading)


def test_base_model_sampling(base_client) -> None:
    assert len(greedy(base_client, PROMPT, max_tokens=4)) == 4


def test_full_fine_tuning_is_refused_naming_the_alternative(service) -> None:
    training = service.create_lora_training_client(base_model=QWEN, rank=0).result(timeout=120)  # full fine-tuning
    train(training, 1)
    with pytest.raises(Exception, match="--sampler native"):
        training.save_weights_and_get_sampling_client().result(timeout=120)


def test_a_lora_rank_vllm_cannot_take_is_refused_at_create(service) -> None:
    with pytest.raises(Exception, match="--vllm-max-lora-rank"):
        service.create_lora_training_client(base_model=QWEN, rank=2 * MAX_LORA_RANK).result(timeout=120)


def test_the_cookbook_rl_recipe_runs_unmodified(server, qwen_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, root_logging: None) -> None:
    """``recipes/rl_basic`` (``rl/train``, LoRA clients, sampling through ``save_weights_and_get_sampling_client``)
    on the vLLM sampler: every step samples its new snapshot on vLLM and trains on the rollouts."""
    import json

    pytest.importorskip("tinker_cookbook.rl.train", reason="install requirements/tinker-cookbook.txt (--no-deps)")
    ChatLettersDatasetBuilder = load_example("chat_letters").ChatLettersDatasetBuilder
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.recipes import rl_basic
    from transformers import AutoTokenizer

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    tokenizer_utils.register_tokenizer(QWEN, lambda: AutoTokenizer.from_pretrained(str(qwen_dir)))
    log_path = tmp_path / "rl_basic"
    config = rl_basic.build_config_blueprint(QWEN).apply({
        "dataset_builder": ChatLettersDatasetBuilder(renderer_name="role_colon", model_name_for_tokenizer=QWEN,
                                                     batches=3, batch_size=2, group_size=4, max_tokens=8),
        "base_url": server.base_url, "log_path": str(log_path), "learning_rate": 3e-2, "lora_rank": 8,
        "max_tokens": 8, "num_groups_to_log": 0, "rollout_json_export": False, "save_every": 0}).make()
    rl_basic.main(config)
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [row["env/all/reward/total"] for row in rows if "env/all/reward/total" in row]
    assert len(rewards) == 3 and all(0.0 <= r <= 1.0 for r in rewards)

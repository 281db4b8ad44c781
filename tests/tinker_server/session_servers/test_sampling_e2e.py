"""End to end, per ZeRO stage: sampling through the official SDK.

What RL users rely on: a sampler sees exactly the weights of the last ``optim_step`` before its
snapshot (later steps do not leak into it), the logprobs it returns equal a training-side
``forward`` on the same tokens (importance sampling divides one by the other), seeded sampling
repeats, a sample in the middle of an accumulation leaves that step's update bit for bit alone,
the SamplingParams mean what they say, and bad input is a ``user`` error.
Logprob tolerance 1e-4 as in test_sdk_e2e (the sampler is a plain copy of the model, the trainer
runs it inside DeepSpeed; both fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import (  # noqa: E402
    API_KEY,
    RESULT_TIMEOUT_S,
    adam,
    max_weight_difference,
    random_data,
    saved_weights,
    to_sdk,
)

pytestmark = pytest.mark.pr("zero-0-1")

LOGPROB_ATOL = 1e-4
BASE = "tiny-llama-byte"
PROMPT = list(b"Sample me:")


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


def step(training, rng: np.random.Generator, calls: tuple[int, ...] = (3, 2), lr: float = 2e-2) -> None:
    futures = [training.forward_backward(to_sdk(random_data(rng, n)), "cross_entropy") for n in calls]
    optim = training.optim_step(types.AdamParams(**adam(learning_rate=lr)))
    for future in futures:
        future.result(timeout=RESULT_TIMEOUT_S)
    optim.result(timeout=RESULT_TIMEOUT_S)


def sample(sampler, num_samples: int = 3, prompt: list[int] = PROMPT, **params):
    params = {"max_tokens": 10, "seed": 17, **params}
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples, types.SamplingParams(**params),
                          include_prompt_logprobs=True).result(timeout=RESULT_TIMEOUT_S)


def training_logprobs(training, prompt: list[int], completion: list[int]) -> np.ndarray:
    """A training-side forward over prompt + completion: the logprob of every token after the first."""
    full = prompt + completion
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})
    return np.asarray(training.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
                      .loss_fn_outputs[0]["logprobs"].data)


def assert_matches_training(result, training, prompt: list[int] = PROMPT) -> None:
    for sequence in result.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) > 0
        expected = training_logprobs(training, prompt, sequence.tokens)
        np.testing.assert_allclose(sequence.logprobs, expected[len(prompt) - 1:], atol=LOGPROB_ATOL)
        np.testing.assert_allclose(result.prompt_logprobs[1:], expected[:len(prompt) - 1], atol=LOGPROB_ATOL)
    assert result.prompt_logprobs[0] is None


def tokens_of(result) -> list[list[int]]:
    return [list(s.tokens) for s in result.sequences]


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_samplers_see_the_last_step_and_report_training_logprobs(server, service, lora_rank: int) -> None:
    if lora_rank == 0 and server.zero_stage not in (0, 3):
        pytest.skip("full fine-tuning is covered on ZeRO 0 and 3")
    rng = np.random.default_rng(60 + lora_rank)
    training = service.create_lora_training_client(base_model=BASE, rank=lora_rank, seed=9).result(timeout=120)
    step(training, rng)
    first = training.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    before = sample(first)
    assert_matches_training(before, training)
    assert tokens_of(sample(first)) == tokens_of(before), "the same seed samples the same tokens"
    assert tokens_of(sample(first, seed=18)) != tokens_of(before), "another seed samples other tokens"

    step(training, rng)
    later = sample(first)
    assert tokens_of(later) == tokens_of(before), "a snapshot keeps its weights after later steps"
    np.testing.assert_array_equal(later.sequences[0].logprobs, before.sequences[0].logprobs)
    second = training.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    after = sample(second)
    assert_matches_training(after, training)
    moved = np.abs(training_logprobs(training, PROMPT, tokens_of(before)[0])[len(PROMPT) - 1:]
                   - before.sequences[0].logprobs).max()
    assert moved > 100 * LOGPROB_ATOL, "the step must change the logprobs, or the comparison says nothing"

    named = training.save_weights_for_sampler("after-two-steps").result(timeout=RESULT_TIMEOUT_S)
    assert named.path.endswith("/sampler_weights/after-two-steps")
    from_path = service.create_sampling_client(model_path=named.path)
    assert from_path.get_base_model() == BASE
    np.testing.assert_array_equal(sample(from_path).sequences[0].logprobs, after.sequences[0].logprobs)
    logprobs = from_path.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=RESULT_TIMEOUT_S)
    assert logprobs[0] is None
    np.testing.assert_allclose(logprobs[1:], after.prompt_logprobs[1:], atol=1e-6)


def test_a_sample_mid_accumulation_changes_nothing_in_the_step(server, service) -> None:
    data = [random_data(np.random.default_rng(70 + i), 3) for i in range(2)]
    results = []
    for interleave in (False, True):
        training = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result(timeout=120)
        first = training.forward_backward(to_sdk(data[0]), "cross_entropy")
        if interleave:  # snapshot (a collective under ZeRO-3) and sample between two calls of one step
            sampler = training.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
            sample(sampler)
        second = training.forward_backward(to_sdk(data[1]), "cross_entropy")
        metrics = training.optim_step(types.AdamParams(**adam())).result(timeout=RESULT_TIMEOUT_S).metrics
        first.result(timeout=RESULT_TIMEOUT_S), second.result(timeout=RESULT_TIMEOUT_S)
        assert metrics["fwdbwd_requests:sum"] == 2 and metrics["datums:sum"] == 6
        saved = training.save_state(f"mid-{interleave}").result(timeout=RESULT_TIMEOUT_S)
        results.append(saved_weights(server.checkpoint_dir, saved.path))
    assert max_weight_difference(results[1], results[0]) == 0.0, "sampling changed the accumulated step"


def test_sampling_params_mean_what_they_say(server, service) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result(timeout=120)
    step(training, np.random.default_rng(80), lr=5e-2)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    greedy = tokens_of(sample(sampler, 1, temperature=0.0, max_tokens=12))[0]
    assert tokens_of(sample(sampler, 2, temperature=0.0, max_tokens=12, seed=5)) == [greedy, greedy]
    assert tokens_of(sample(sampler, 2, top_k=1, max_tokens=12)) == [greedy, greedy], "top_k=1 is greedy"
    assert tokens_of(sample(sampler, 1, top_p=1e-6, max_tokens=12)) == [greedy], "a tiny nucleus is greedy"

    result = sample(sampler, 5, max_tokens=7, stop=[])
    assert [len(s.tokens) for s in result.sequences] == [7] * 5
    assert {s.stop_reason for s in result.sequences} == {"length"}

    stop_token = greedy[4]
    stopped = sample(sampler, 1, temperature=0.0, max_tokens=12, stop=[stop_token]).sequences[0]
    assert stopped.stop_reason == "stop" and list(stopped.tokens) == greedy[:greedy.index(stop_token) + 1]
    ascii_tokens = [t for t in greedy if 32 <= t < 127]  # a stop string is text: use a byte that is one
    if ascii_tokens:
        stop_string = chr(ascii_tokens[-1])
        stopped = sample(sampler, 1, temperature=0.0, max_tokens=12, stop=[stop_string]).sequences[0]
        assert stopped.stop_reason == "stop" and list(stopped.tokens) == greedy[:greedy.index(ascii_tokens[-1]) + 1]

    top = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=4, seed=2),
                         topk_prompt_logprobs=3, topk_sample_logprobs=2).result(timeout=RESULT_TIMEOUT_S)
    assert top.topk_prompt_logprobs[0] is None and [len(x) for x in top.topk_prompt_logprobs[1:]] == [3] * 9
    first = top.topk_prompt_logprobs[1]
    assert [v for _, v in first] == sorted((v for _, v in first), reverse=True)
    assert first[0][1] >= top.prompt_logprobs[1] - 1e-5, "the best token is at least as likely as the actual one"
    sequence = top.sequences[0]
    assert [len(x) for x in sequence.topk_logprobs] == [2] * 4
    assert all(best[0][1] >= lp - 1e-5 for best, lp in zip(sequence.topk_logprobs, sequence.logprobs))

    hot = sample(sampler, 8, temperature=5.0, max_tokens=12)
    cold = sample(sampler, 8, temperature=0.2, max_tokens=12)
    assert len({tuple(t) for t in tokens_of(hot)}) >= len({tuple(t) for t in tokens_of(cold)})
    assert_matches_training(hot, training)  # logprobs are the model's own, whatever the temperature


def assert_user_error(future) -> str:
    with pytest.raises(tinker.RequestFailedError) as failure:
        future.result(timeout=RESULT_TIMEOUT_S)
    assert failure.value.category == types.RequestErrorCategory.User, failure.value
    return str(failure.value)


def test_bad_sampling_input_is_a_user_error_and_the_server_keeps_serving(server, service) -> None:
    sampler = service.create_sampling_client(base_model=BASE)
    cases = {
        "empty prompt": ([], types.SamplingParams(max_tokens=4)),
        "exceeds the context length": (PROMPT, types.SamplingParams(max_tokens=1000)),
        "temperature must be >= 0": (PROMPT, types.SamplingParams(max_tokens=4, temperature=-0.5)),
        "top_p must be in (0, 1]": (PROMPT, types.SamplingParams(max_tokens=4, top_p=0.0)),
        "outside the vocabulary": ([1, 2, 300], types.SamplingParams(max_tokens=4)),
    }
    futures = {name: sampler.sample(types.ModelInput.from_ints(prompt), 1, params)
               for name, (prompt, params) in cases.items()}
    unknown = service.create_sampling_client(model_path="tinker://s0:train:9/sampler_weights/missing")
    futures["unknown sampler path"] = unknown.sample(types.ModelInput.from_ints(PROMPT), 1,
                                                     types.SamplingParams(max_tokens=4))
    for name, future in futures.items():
        assert name in assert_user_error(future), name
    good = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=3, seed=1))
    assert [len(s.tokens) for s in good.result(timeout=RESULT_TIMEOUT_S).sequences] == [3, 3]


def test_a_local_hugging_face_model_trains_and_samples(server, service) -> None:
    path = server.local_model
    training = service.create_lora_training_client(base_model=path, rank=4, seed=2).result(timeout=120)
    info = training.get_info()
    assert info.model_data.arch == "gpt2" and info.model_data.tokenizer_id == path
    tokenizer = training.get_tokenizer()  # offline: the model directory has the tokenizer
    ids = tokenizer.encode("hello, tinker", add_special_tokens=False)
    assert ids == list(b"hello, tinker")
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    before = training.forward_backward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"]
    training.optim_step(types.AdamParams(**adam(learning_rate=5e-2))).result(timeout=RESULT_TIMEOUT_S)
    after = training.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"]
    assert after < before, "one step on the datum lowers its loss"
    sampler = training.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    result = sample(sampler, 2, prompt=ids[:5], max_tokens=6)
    assert_matches_training(result, training, ids[:5])

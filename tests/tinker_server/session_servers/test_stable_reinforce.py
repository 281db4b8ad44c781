"""``stable_reinforce`` with ``record_stability_info``: the records, the provenance checks, and the loss through the
SDK (sample with ``record_stability_info=True``, train on datums naming the sampled sequences, as tinker-cookbook's
``rl_loop`` builds them). The loss's formula (this server's choice; Tinker publishes none) is checked against
``reference_elementwise_loss`` in ``test_losses.py``; here, end to end, ``loss:sum`` equals it on the server's own
logprobs and the sampler's recorded ones.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import API_KEY, RESULT_TIMEOUT_S, adam, reference_elementwise_loss  # noqa: E402

from deepspeed_tinker.stability import RECORD_TTL_S, StabilityRecords, resolve_provenance  # noqa: E402
from deepspeed_tinker.wire import Datum, Span, UserError  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")
PROMPT = (5, 6, 7)
SAMPLED = np.array([8, 9], np.int32)
SAMPLER_LOGPROBS = np.array([-0.5, -1.5], np.float32)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def records(clock: Clock | None = None) -> StabilityRecords:
    """Two sequences of session ``s`` sampled by one request (``req-1``), and one of session ``other``."""
    result = SimpleNamespace(sequences=[SimpleNamespace(tokens=SAMPLED, logprobs=SAMPLER_LOGPROBS),
                                        SimpleNamespace(tokens=SAMPLED[::-1], logprobs=SAMPLER_LOGPROBS[::-1])])
    store = StabilityRecords(clock or Clock())
    store.record("s", ["a", "b"], "req-1", PROMPT)
    store.record("other", ["c"], "req-1", PROMPT)
    store.record("s", ["pending"], "req-2", PROMPT)
    store.finished("req-1", result)  # as the future store reports it; req-2 is still sampling
    return store


def rollout(sequence_id: str = "a", targets: tuple[int, ...] = (6, 7, 8, 9)) -> Datum:
    """Prompt + sampled tokens shifted by one, with the cookbook's spans (``rl_loop.with_sampled_provenance``)."""
    return Datum(np.array([5, 6, 7, 8]), np.array(targets), np.ones(4, np.float32), None,
                 np.array([0.0, 0.0, 1.5, 1.5], np.float32),
                 input_spans=(Span(False, sequence_id, 0, 3), Span(True, sequence_id, 0, 1)),
                 target_spans=(Span(False, sequence_id, 1, 2), Span(True, sequence_id, 0, 2)))


def test_spans_take_the_recorded_logprobs_and_train_only_sampled_targets() -> None:
    resolved = resolve_provenance(rollout(), 0, records(), "s")
    assert resolved.sampling_logprobs.tolist() == [0.0, 0.0, -0.5, -1.5]
    assert resolved.weights.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("datum, session, message", [
    (rollout(), "other", "no recorded sequence 'a' in this session"),
    (rollout("c"), "s", "no recorded sequence 'c'"),
    (rollout("nope"), "s", "no recorded sequence 'nope'"),
    (rollout("pending"), "s", "not sampled yet"),
    (rollout("b"), "s", "tokens differ from those 'b' recorded"),
    (rollout(targets=(6, 7, 8, 1)), "s", r"target_tokens\[2:4\]: the tokens differ"),
    (Datum(np.array([5, 6, 7, 8]), np.array([6, 7, 8, 9]), np.ones(4, np.float32)), "s", "needs provenance"),
    (Datum(np.array([9]), np.array([8]), np.ones(1, np.float32), input_spans=(Span(True, "a", 1, 1), ),
           target_spans=(Span(True, "a", 2, 1), )), "s", "beyond its 2 sampled tokens"),
    (Datum(np.array([5, 6]), np.array([6, 7]), np.ones(2, np.float32), input_spans=(Span(False, "a", 0, 2), ),
           target_spans=(Span(False, "a", 1, 2), )), "s", "no target is a sampled token"),
])
def test_provenance_that_does_not_match_the_record_is_a_user_error(datum: Datum, session: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        resolve_provenance(datum, 0, records(), session)


def test_records_expire_a_day_after_their_last_use() -> None:
    clock = Clock()
    store = records(clock)
    clock.now = RECORD_TTL_S - 1
    resolve_provenance(rollout(), 0, store, "s")  # restarts a's day
    clock.now = 2 * RECORD_TTL_S - 2
    resolve_provenance(rollout(), 0, store, "s")
    clock.now = 3 * RECORD_TTL_S
    with pytest.raises(UserError, match="expire"):
        resolve_provenance(rollout(), 0, store, "s")


def with_provenance(prompt: list[int], sequence: types.SampledSequence, advantage: float) -> types.Datum:
    """A datum as tinker-cookbook's ``rl_loop`` builds one: prompt + sampled tokens, advantages on the sampled."""
    tokens = prompt + list(sequence.tokens)
    n = len(sequence.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "logprobs": [0.0] * (len(prompt) - 1) + list(sequence.logprobs),
                                        "advantages": [0.0] * (len(prompt) - 1) + [advantage] * n})
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=n - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=n)])


def test_the_sdk_samples_with_stability_info_and_trains_stable_reinforce(server) -> None:
    if server.zero_stage != 2:
        pytest.skip("one stage is enough: the loss runs through the same per-token path as the others")
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        training = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4, seed=2).result(
            timeout=RESULT_TIMEOUT_S)
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result(
            timeout=RESULT_TIMEOUT_S)
        prompt = list(b"abc")
        sequences = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(
            max_tokens=6, seed=3, stop=[])).result(timeout=RESULT_TIMEOUT_S).sequences
        assert len({s.sequence_id for s in sequences}) == 4
        data = [with_provenance(prompt, s, a) for s, a in zip(sequences, (1.0, -1.0, 0.5, -0.5))]
        # The weights move between sampling and this step, so the importance weights are not all 1.
        training.forward_backward(data, "importance_sampling").result(timeout=RESULT_TIMEOUT_S)
        training.optim_step(types.AdamParams(**adam(learning_rate=0.2))).result(timeout=RESULT_TIMEOUT_S)

        config = {"clip_high_threshold": 1.05}
        output = training.forward_backward(data, "stable_reinforce", config).result(timeout=RESULT_TIMEOUT_S)
        expected, ratios = 0.0, []
        for datum, out, sequence in zip(data, output.loss_fn_outputs, sequences):
            logprobs = out["logprobs"].to_torch()
            n = len(sequence.tokens)
            recorded = [0.0] * (len(prompt) - 1) + list(sequence.logprobs)
            sampled = [0.0] * (len(prompt) - 1) + [1.0] * n
            reference = reference_elementwise_loss("stable_reinforce", logprobs, {
                "logprobs": recorded, "advantages": datum.loss_fn_inputs["advantages"].data, "weights": sampled},
                config)
            np.testing.assert_allclose(out["elementwise_loss"].to_numpy(), reference.numpy(), rtol=1e-5, atol=1e-6)
            expected += float(reference.sum())
            ratios += torch.exp(logprobs[-n:] - torch.tensor(sequence.logprobs)).tolist()
        assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
        assert max(ratios) > 1.05 and min(ratios) < 1.0, "some weights are truncated, some not"
        training.optim_step(types.AdamParams(**adam())).result(timeout=RESULT_TIMEOUT_S)

        impostor = dataclasses.replace(sequences[1], sequence_id=sequences[0].sequence_id)
        assert list(impostor.tokens) != list(sequences[0].tokens)
        bad = [with_provenance(prompt, impostor, 1.0)]  # claims tokens the named sequence did not sample
        with pytest.raises(tinker.RequestFailedError, match="differ from those"):
            training.forward_backward(bad, "stable_reinforce").result(timeout=RESULT_TIMEOUT_S)
        other = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4).result(timeout=120)
        assert other.forward_backward(data[:1], "stable_reinforce").result(timeout=RESULT_TIMEOUT_S).metrics
    finally:
        service.close("success").result(timeout=30)

"""The batched sampler (``sampler.generate``) against the sampler it replaced (``generate_reference``, the
oracle beside these tests in sampling_reference.py),
in process, no ranks: on fixed seeds they give the same tokens, stop reasons and logprobs (bit for bit: the logprobs
come from the same scoring forward as before; the tokens from the same draws on logits that may differ in the last
bits, see ``sampler.generate``, which changes no token here), over temperatures,
top-k, top-p, greedy, stop tokens, stop strings (multi-byte ones too) and sample counts; and the incremental
stop-string check equals decoding the whole completion at every token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker_sdk_helpers import require

require("transformers")
require("peft")

from sampling_reference import generate_reference  # noqa: E402

from deepspeed_tinker.model import LoraSpec, build_model, register_local_model  # noqa: E402
from deepspeed_tinker.sampler import StopStrings, _decoder, generate, score  # noqa: E402
from deepspeed_tinker.sampling import SampleJob, SnapshotRef  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster than two fighting over a busy machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def job(prompt: list[int], seeds: list[int], **params) -> SampleJob:
    fields = dict(max_tokens=24, temperature=1.0, top_k=-1, top_p=1.0, stop_tokens=(), stop_strings=())
    fields.update(params)
    return SampleJob(SnapshotRef("x", "tiny-llama-byte"), tuple(prompt), len(seeds), seeds=tuple(seeds), **fields)


def peaked(model: torch.nn.Module) -> torch.nn.Module:
    """A random model is near uniform over its vocabulary; scale the unembedding so it has preferences (then
    stop tokens and strings are hit at varied steps, and top-k/top-p cut)."""
    head = model.get_output_embeddings()
    head = getattr(head, "base_layer", head)
    with torch.no_grad():
        head.weight.mul_(40.0)
    return model.eval()


#: Sampling parameters; ``stops`` picks stop tokens / strings from what an unstopped run of the same samples
#: generated (a random model's favourite bytes are not known in advance), so some samples stop early, at varied steps.
CASES = {
    "plain": dict(),
    "hot-topk": dict(temperature=1.3, top_k=20),
    "topp": dict(temperature=0.8, top_p=0.7),
    "greedy": dict(temperature=0.0, stops="tokens"),
    "stop-tokens": dict(stops="tokens"),
    "stop-strings": dict(stops="strings"),
    "both": dict(temperature=0.9, top_k=40, stops="both"),
}


def stops_from(completions: list[list[int]], kind: str, rng: np.random.Generator) -> dict:
    """Stop tokens (two tokens some completion made) and strings (a 1- and a 2-byte piece of some completion,
    decoded with ``errors="replace"``, plus one that never occurs)."""
    out: dict = {}
    picks = [c[int(rng.integers(1, len(c)))] for c in completions[:2]]
    if kind in ("tokens", "both"):
        out["stop_tokens"] = tuple(sorted(set(picks)))
    if kind in ("strings", "both"):
        c = completions[-1]
        at = int(rng.integers(2, len(c) - 2))
        out["stop_strings"] = (bytes(c[at:at + 2]).decode("utf-8", "replace"),
                               bytes(c[at - 1:at]).decode("utf-8", "replace"), "\u00e9t\u00e9")
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_batched_sampler_equals_the_reference(case: str) -> None:
    model = peaked(build_model("tiny-llama-byte", LoraSpec(rank=2, seed=0)))
    decode = _decoder("tiny-llama-byte")
    rng = np.random.default_rng(sorted(CASES).index(case))
    stopped = 0
    params = dict(CASES[case])
    stops = params.pop("stops", None)
    for trial in range(3):
        prompt = torch.tensor(rng.integers(0, 256, int(rng.integers(1, 12))).tolist())
        seeds = [int(s) for s in rng.integers(0, 2**62, [3, 8, 1][trial])]
        j = job(prompt.tolist(), seeds, **params)
        if stops:
            unstopped = generate_reference(model, prompt, j, seeds, decode)
            j = job(prompt.tolist(), seeds, **params, **stops_from([c for c, _ in unstopped], stops, rng))
        new, old = (fn(model, prompt, j, seeds, decode) for fn in (generate, generate_reference))
        assert new == old, (case, trial)
        stopped += sum(reason == "stop" for _, reason in new)
        for a, b in zip(score(model, prompt, new, 3), score(model, prompt, old, 3)):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    if stops:
        assert stopped, "no sample stopped early: the case tests nothing about stopping"


def test_the_batched_sampler_equals_the_reference_on_a_local_chat_model(tmp_path) -> None:
    """A tiny Qwen3 (local directory, a tokenizer with special tokens): its EOS, a stop string, several samples."""
    from deepspeed_tinker.tiny_models import build_tiny_model

    spec = register_local_model(str(build_tiny_model(tmp_path / "qwen3", "qwen3")))
    model = peaked(build_model(spec.name, LoraSpec(rank=2, seed=0)))
    decode = _decoder(spec.name)
    prompt = torch.tensor(list(b"<chat>"))
    for params in (dict(stop_tokens=spec.eos_token_ids), dict(stop_strings=("<|im_end|>", "a")),
                   dict(temperature=0.0, stop_strings=("e",))):
        seeds = [11, 12, 13, 14, 15]
        j = job(prompt.tolist(), seeds, **params)
        assert generate(model, prompt, j, seeds, decode) == generate_reference(model, prompt, j, seeds, decode)


@pytest.mark.parametrize("kind", ["bytes", "chat-tokenizer"])
def test_incremental_stop_strings_equal_decoding_everything(kind: str, tmp_path) -> None:
    """First index where ``s in decode(tokens[:i + 1])``, against ``StopStrings``: random tokens, stops that are
    ASCII, multi-byte (split over tokens), special tokens and mixes."""
    if kind == "bytes":
        decode = _decoder("tiny-llama-byte")
        vocab = 256
    else:
        from deepspeed_tinker.tiny_models import build_tiny_model

        spec = register_local_model(str(build_tiny_model(tmp_path / "qwen3", "qwen3")))
        decode, vocab = _decoder(spec.name), spec.vocab_size - 2
    stops_list = [("a",), ("ab", "\u00e9"), ("\u00e9t\u00e9",), ("<|im_end|>", "x y"), ("\ufffd\u00e9",)]
    rng = np.random.default_rng(0)
    alphabet = list(b"abtxy \xc3\xa9") + [vocab - 1, vocab - 2]
    for trial in range(300):
        pool = alphabet if trial % 2 else list(range(vocab))
        tokens = [int(t) for t in rng.choice(pool, 40)]
        for stops in stops_list:
            expected = next((i for i in range(len(tokens)) if any(s in decode(tokens[:i + 1]) for s in stops)), None)
            checker = StopStrings(stops, decode)
            got = next((i for i, t in enumerate(tokens) if checker.add(t)), None)
            assert got == expected, (kind, stops, tokens)


@pytest.mark.parametrize("lengths", [(6, 6, 6, 6), (6, 6, 2, 11, 4)], ids=["one-length", "mixed-lengths"])
def test_requests_batched_together_equal_each_alone(lengths: tuple[int, ...]) -> None:
    """``generate_batch``: requests (two of them with the same prompt; prompts of one length, or of several,
    left-padded in the batch) decode as one batch, and each request's samples are the reference's for its prompt and
    seeds."""
    from deepspeed_tinker.sampler import generate_batch

    model = peaked(build_model("tiny-llama-byte", LoraSpec(rank=2, seed=0)))
    decode = _decoder("tiny-llama-byte")
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]
    prompts[1] = prompts[0]
    seeds = [[int(s) for s in rng.integers(0, 2**62, k)] for k in (1, 4, 2, 3, 2)[:len(prompts)]]
    for params in ({}, {"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9}):
        first = job(prompts[0], seeds[0], max_tokens=20, **params)
        unstopped = generate_reference(model, torch.tensor(prompts[2]), first, seeds[2], decode)
        j = job(prompts[0], seeds[0], max_tokens=20, **params,
                **stops_from([c for c, _ in unstopped], "both", rng))
        batched = generate_batch(model, [(torch.tensor(p), s) for p, s in zip(prompts, seeds)], j, decode)
        assert [len(b) for b in batched] == [len(s) for s in seeds]
        for prompt, request_seeds, got in zip(prompts, seeds, batched):
            assert got == generate_reference(model, torch.tensor(prompt), j, request_seeds, decode)
        assert any(reason == "stop" for b in batched for _, reason in b)


def test_sample_many_equals_one_request_at_a_time() -> None:
    """``SamplerPool.sample_many`` (what a rank runs for concurrent requests): grouped by weights and sampling
    parameters, each request's share and prompt logprobs equal ``sample`` on it alone; a request whose weights
    are gone fails alone, with a user error."""
    from deepspeed_tinker.sampler import SamplerPool

    pool = SamplerPool(torch.device("cpu"))
    trained = build_model("tiny-llama-byte", LoraSpec(rank=2, seed=0))
    lora = {"rank": 2, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
    for name, scale in (("a", 0.5), ("b", -0.3)):
        pool.keep(name, {n: torch.randn_like(p) * scale for n, p in trained.named_parameters() if "lora_" in n})
    rng = np.random.default_rng(3)

    def request(snapshot: str, length: int, n: int, **params) -> SampleJob:
        fields = dict(max_tokens=12, temperature=1.0, top_k=-1, top_p=1.0, stop_tokens=(7, 9), stop_strings=())
        fields.update(params)
        return SampleJob(SnapshotRef(snapshot, "tiny-llama-byte", lora), tuple(rng.integers(0, 256, length).tolist()),
                         n, seeds=tuple(int(s) for s in rng.integers(0, 2**62, n)), prompt_logprobs=True, **fields)

    jobs = [request("a", 5, 3), request("a", 5, 2), request("b", 5, 2), request("a", 8, 1),
            request("a", 5, 2, temperature=0.5), request("gone", 5, 2), request("a", 5, 4, top_k=10)]
    shares = [range(0, j.num_samples) for j in jobs]
    shares[1] = range(1, 2)  # a rank's share can be part of a request, or nothing
    shares[2] = range(0, 0)
    results = pool.sample_many(jobs, shares, with_prompt=True)
    for j, (job_, share_, (status, part)) in enumerate(zip(jobs, shares, results)):
        if job_.snapshot.snapshot_id == "gone":
            assert status == "user" and "no longer held" in part
            continue
        assert status == "ok", part
        alone = pool.sample(job_, share_, with_prompt=True)
        assert len(part["sequences"]) == len(share_) == len(alone["sequences"])
        for x, y in zip(part["sequences"], alone["sequences"]):
            assert x.stop_reason == y.stop_reason
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
        np.testing.assert_array_equal(part["prompt"]["logprobs"], alone["prompt"]["logprobs"])


def test_the_scheduler_hands_out_consecutive_sampling_requests_in_order() -> None:
    from deepspeed_tinker.scheduler import FutureStore, Scheduler

    scheduler = Scheduler(FutureStore())
    for kind in ("sample", "sample", "sample", "create", "sample"):
        scheduler.submit(kind, "m", kind)
    first = scheduler.next_job(timeout=0)
    assert first.kind == "sample"
    assert [j.kind for j in scheduler.take_consecutive("sample", 1)] == ["sample"]
    assert [j.kind for j in scheduler.take_consecutive("sample", 5)] == ["sample"]  # stops at the create
    assert scheduler.take_consecutive("sample", 5) == []
    assert scheduler.next_job(timeout=0).kind == "create"
    assert scheduler.next_job(timeout=0).kind == "sample"


def test_concurrent_sdk_requests_equal_sequential_ones(server) -> None:
    """Through the SDK on the ZeRO-1 server: a long request keeps the ranks busy while 8 more arrive (2 of them with
    the same prompt, as tinker-cookbook's per-environment requests of a group; prompts of 5, 11 and 12 tokens), which
    the server then samples as one batch; every request's tokens and logprobs equal the same request sent alone.
    (One stage: batching is rank-side sampling, the same at every ZeRO stage.)"""
    if server.zero_stage != 1:
        pytest.skip("one stage is enough: sampling never touches the engine")
    tinker = require("tinker")
    from tinker import types
    from tinker_sdk_helpers import API_KEY, RESULT_TIMEOUT_S, adam

    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        training = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4, seed=5).result(
            timeout=RESULT_TIMEOUT_S)
        ids = list(b"batched sampling, the same samples")
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:]})
        training.forward_backward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        training.optim_step(types.AdamParams(**adam(learning_rate=5e-2))).result(timeout=RESULT_TIMEOUT_S)
        sampler = training.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
        prompts = [b"alpha", b"alpha", b"gamma", b"delta", b"omega", b"sigma", b"long prompt", b"other prompt"]
        params = [types.SamplingParams(max_tokens=16, temperature=1.0, seed=i, stop=[101, 32]) for i in range(8)]

        def send(i: int):
            return sampler.sample(types.ModelInput.from_ints(list(prompts[i])), 2, params[i])

        def outputs(result) -> list:
            return [(list(s.tokens), list(s.logprobs), s.stop_reason) for s in result.sequences]

        alone = [outputs(send(i).result(timeout=RESULT_TIMEOUT_S)) for i in range(8)]
        busy = sampler.sample(types.ModelInput.from_ints(list(b"busy")), 4,
                              types.SamplingParams(max_tokens=200, seed=1, stop=[]))
        together = [send(i) for i in range(8)]
        assert [outputs(f.result(timeout=RESULT_TIMEOUT_S)) for f in together] == alone
        assert [len(s.tokens) for s in busy.result(timeout=RESULT_TIMEOUT_S).sequences] == [200] * 4
        assert any(reason == "stop" for out in alone for _, _, reason in out)
    finally:
        service.close("success").result(timeout=30)


def test_eos_stops_a_sample_that_has_stop_strings_too() -> None:
    """Stop strings do not turn off the model's EOS (tinker-cookbook's ``role_colon`` renderer stops on a string):
    a request parsed with stop strings that never occur ends at the first EOS token, reason ``stop``, the same tokens
    as an unstopped run up to there. A random model's EOS is rarely drawn, so one of its drawn tokens plays EOS."""
    from dataclasses import replace

    from deepspeed_tinker.model import BASE_MODELS
    from deepspeed_tinker.sampling import parse_sample

    spec = BASE_MODELS["tiny-llama-byte"]
    model = peaked(build_model("tiny-llama-byte", LoraSpec(rank=2, seed=0)))
    decode = _decoder("tiny-llama-byte")
    prompt = [5, 6, 7]
    request = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "num_samples": 1,
               "sampling_params": {"max_tokens": 24, "seed": 3, "stop": ["\u00e9t\u00e9-never"]}}

    def parsed(eos: tuple[int, ...]) -> SampleJob:
        return parse_sample(request, SnapshotRef("x", "tiny-llama-byte"), spec.vocab_size, spec.max_context_length,
                            eos, 0)

    free_job = replace(parsed(()), stop_tokens=(), stop_strings=())
    ((free, _), ) = generate(model, torch.tensor(prompt), free_job, list(free_job.seeds), decode)
    eos = free[len(free) // 2]
    first = free.index(eos)
    stopping = parsed((eos, ))
    assert stopping.stop_strings == ("\u00e9t\u00e9-never", ) and stopping.stop_tokens == (eos, )
    ((tokens, reason), ) = generate(model, torch.tensor(prompt), stopping, list(stopping.seeds), decode)
    assert (tokens, reason) == (free[:first + 1], "stop")

"""Training passes bounded in memory (issue 44): ``token_logprobs`` runs the output layer on a chunk of positions at
a time and again in backward, so no T x V logits tensor exists at once; against the path before it (every position's
logits at once, then ``log_softmax``).

Tolerance. Each position's logits, softmax and logprob are its own, so chunking changes only float rounding: the
output layer's matrix product over a chunk's rows may round a row differently from one over all rows (the GEMM
blocks rows), and the weight gradient is summed over positions chunk by chunk. Logprobs: within ``LOGPROB_ATOL``
(2e-6, 4 fp32 ulps of logprobs near -5.5; measured: at most 9.5e-7, mostly equal). Gradients: within ``GRAD_RTOL``
(4e-6) of each gradient's largest element (measured: at most 8.9e-7; a lost or doubled chunk is off by a tenth or
more). With one chunk (T <= chunk) the same kernels run on the same shapes: bit for bit. The sampler's scoring
(``token_logprobs_topk``) is the same computation: bit for bit the training logprobs of the same batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from logprob_chunk_ranks import nonzero_lora_b
from tinker_sdk_helpers import require, run_rank_script, unmanaged_stage_supported

require("peft")
require("transformers")

from deepspeed_tinker.model import LOGITS_CHUNK_TOKENS, LoraSpec, build_model, token_logprobs, token_logprobs_topk  # noqa: E402
from deepspeed_tinker.sampler import score  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")
VOCAB = 256  # the byte-level model's
CHUNK = 8
LOGPROB_ATOL = 2e-6
GRAD_RTOL = 4e-6
RANKS_SCRIPT = Path(__file__).with_name("logprob_chunk_ranks.py")
LORAS = {"full": None, "lora": LoraSpec(rank=4, seed=0),
         "lora-unembed-only": LoraSpec(rank=4, seed=0, train_attn=False, train_mlp=False, train_unembed=True)}


def built(lora: LoraSpec | None) -> torch.nn.Module:
    """The byte model; LoRA's B matrices made non-zero (PEFT starts them at 0, which zeroes A's gradients)."""
    model = build_model("tiny-llama-byte", lora)
    return nonzero_lora_b(model)


def one_pass(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The path before chunking: every position's logits at once, then ``log_softmax`` over them."""
    logprobs = torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1)
    if targets.dim() == 3:
        return logprobs.gather(-1, targets)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked(chunk_tokens: int):
    return lambda model, tokens, targets: token_logprobs(model, tokens, targets, chunk_tokens=chunk_tokens)


def run(model: torch.nn.Module, function, tokens: torch.Tensor, targets: torch.Tensor) -> tuple:
    """Logprobs and the gradients of a weighted sum of them (distinct weights: a wrong position or slot shows)."""
    model.zero_grad(set_to_none=True)
    logprobs = function(model, tokens, targets)
    (logprobs * torch.linspace(0.5, 2.0, logprobs.numel()).reshape(logprobs.shape)).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def batch(length: int, top_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, VOCAB, (2, length), generator=generator)
    return tokens, torch.randint(0, VOCAB, (*tokens.shape, 3) if top_k else tokens.shape, generator=generator)


@pytest.mark.parametrize("lora", LORAS, ids=list(LORAS))
@pytest.mark.parametrize("top_k", [False, True], ids=["targets", "k-targets"])
def test_chunked_logprobs_and_gradients_match_one_pass_over_all_logits(lora: str, top_k: bool) -> None:
    model = built(LORAS[lora])
    tokens, targets = batch(5 * CHUNK + 3, top_k)  # the last chunk is short
    expected, expected_grads = run(model, one_pass, tokens, targets)
    got, got_grads = run(model, chunked(CHUNK), tokens, targets)
    torch.testing.assert_close(got, expected, rtol=0, atol=LOGPROB_ATOL)
    assert got_grads.keys() == expected_grads.keys() and got_grads
    if LORAS[lora] is not None:
        assert any("lm_head.lora_B" in name for name in got_grads), "LoRA on the unembedding trains"
    for name, grad in expected_grads.items():
        assert grad.abs().max() > 0, name
        error = (got_grads[name] - grad).abs().max().item()
        assert error <= GRAD_RTOL * grad.abs().max().item(), (name, error)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, tokens, targets, chunk_tokens=CHUNK), got), "the same without grad"


@pytest.mark.parametrize("lora", ["full", "lora"])
def test_one_chunk_is_the_one_pass_computation_bit_for_bit(lora: str) -> None:
    model = built(LORAS[lora])
    tokens, targets = batch(3 * CHUNK, False)
    expected, expected_grads = run(model, one_pass, tokens, targets)
    got, got_grads = run(model, chunked(3 * CHUNK), tokens, targets)
    assert torch.equal(got, expected)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert torch.equal(got_grads[name], grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_sampler_scores_with_the_training_computation(dtype: torch.dtype) -> None:
    """``score`` of three completions (a right-padded batch) reports the training logprobs of that batch bit for bit,
    SDPA attention and all, and its top-k are the largest of the one-pass logprobs; ``token_logprobs_topk`` is
    ``token_logprobs`` chunk for chunk."""
    model = built(LoraSpec(rank=4, seed=3)).to(dtype)
    prompt = torch.tensor(list(b"Score me"))
    completions = [(list(text), "length") for text in (b", chunk by chunk", b"!", b" in one batch")]
    p, length = len(prompt), len(prompt) + max(len(c) for c, _ in completions) - 1
    tokens, targets = torch.zeros(3, length, dtype=torch.long), torch.zeros(3, length, dtype=torch.long)
    for i, (completion, _) in enumerate(completions):  # the batch as training pads it: right-padded with zeros
        full = torch.cat([prompt, torch.tensor(completion)])
        tokens[i, :len(full) - 1], targets[i, :len(full) - 1] = full[:-1], full[1:]
    with torch.no_grad():
        trained = token_logprobs(model, tokens, targets)
        reference = torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1)
        for i, sequence in enumerate(score(model, prompt, completions, 4)):
            span = slice(p - 1, p - 1 + len(completions[i][0]))
            assert torch.equal(torch.from_numpy(sequence.logprobs), trained[i, span])
            top = torch.topk(reference[i, span], 4, dim=-1)
            torch.testing.assert_close(torch.from_numpy(sequence.topk_logprobs), top.values, rtol=0,
                                       atol=LOGPROB_ATOL)
        chosen, values, ids = token_logprobs_topk(model, tokens, targets, 2, chunk_tokens=CHUNK)
        assert torch.equal(chosen, token_logprobs(model, tokens, targets, chunk_tokens=CHUNK))
        assert values.shape == ids.shape == (3, length, 2)


def test_no_logits_larger_than_a_chunk_are_made_or_kept_for_backward() -> None:
    model = built(None)
    tokens, _ = batch(6 * CHUNK, False)
    largest_made = [0]

    def record_logits(module, args, output) -> None:
        largest_made[0] = max(largest_made[0], output.numel())

    hook = model.get_output_embeddings().register_forward_hook(record_logits)
    kept: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs = token_logprobs(model, tokens, tokens, chunk_tokens=CHUNK)
    logprobs.sum().backward()  # the chunks' logits are made again here, one chunk at a time
    hook.remove()
    assert largest_made[0] == 2 * CHUNK * VOCAB, "the output layer runs on one chunk of positions at a time"
    logits_like = [shape for shape in kept if len(shape) == 3 and shape[-1] == VOCAB]  # [batch, positions, vocab]
    assert kept and not logits_like, "no logits (nor logprobs over the vocabulary) are kept for backward"
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().max() > 0


#: A fresh process measures one pass's peak resident memory (glibc made to return freed memory, the peak reset
#: before the pass): a vocabulary of 32,768 and 4,096 tokens, so full fp32 logits are 512 MiB.
_PEAK = textwrap.dedent("""
    import ctypes, json, re, sys, torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from deepspeed_tinker.model import token_logprobs
    libc = ctypes.CDLL(None); libc.mallopt(-3, 128 * 1024); libc.mallopt(-1, 128 * 1024)
    def status(field):
        return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
    torch.set_num_threads(1); torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32768, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False))
    ids = torch.randint(0, 32768, (1, 4097))
    chunk = int(sys.argv[1])
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    token_logprobs(model, ids[:, :-1], ids[:, 1:], chunk_tokens=chunk).sum().backward()
    print(json.dumps({"pass_bytes": status("VmHWM") - before}))
""")


def pass_peak_bytes(chunk_tokens: int) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK, str(chunk_tokens)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["pass_bytes"]


def test_a_long_pass_peaks_below_what_its_full_logits_alone_would_take() -> None:
    """4,096 tokens, vocabulary 32,768: the whole sequence as one chunk (the one-pass computation) peaks at two or
    more full logits tensors (logits, log-softmax, their gradients); chunks of ``LOGITS_CHUNK_TOKENS`` peak below
    one."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident memory")
    full_logits = 4096 * 32768 * 4
    one_chunk = pass_peak_bytes(4096)
    assert one_chunk > 2 * full_logits, f"the measurement must see the full logits: {one_chunk / 2**20:.0f} MiB"
    chunked_peak = pass_peak_bytes(LOGITS_CHUNK_TOKENS)
    assert chunked_peak < full_logits, f"chunked: {chunked_peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_chunks_under_zero_on_real_ranks_match_the_one_pass_path(tmp_path: Path, zero_stage: int) -> None:
    """2 gloo ranks, real DeepSpeed engines with every parameter partitioned (ZeRO-3: persistence threshold 0):
    full fine-tuning and LoRA with ``train_unembed``, both also with the output layer tied to the embedding;
    logprobs and reduced gradients of the chunked path against the one-pass path on the same engine weights and
    batches, the ranks with different numbers of chunks, two passes (the second on ZeRO-3's recorded module trace,
    which a per-rank number of hooked calls breaks)."""
    if not unmanaged_stage_supported(zero_stage):
        pytest.skip(f"this DeepSpeed does not support unmanaged mode with ZeRO stage {zero_stage}")
    for report in run_rank_script(RANKS_SCRIPT, [str(zero_stage)], tmp_path, 2, timeout_s=600):
        for case in ("full", "lora", "tied-full", "tied-lora"):
            one, got = report[case]["one_pass"], report[case]["chunked"]
            if zero_stage == 3:  # the output layer's weights were partitioned, not whole on each rank
                assert got["head_partitions"] and all(part < whole for part, whole in got["head_partitions"].values())
            if case != "tied-lora":  # LoRA leaves a tied output layer alone (PEFT would untie it)
                assert any("lm_head" in name or "embed_tokens" in name for name in got["grads"]), "it trains"
            torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(one["logprobs"]), rtol=0,
                                       atol=LOGPROB_ATOL)
            torch.testing.assert_close(torch.tensor(got["no_grad"]), torch.tensor(got["logprobs"]), rtol=0, atol=0)
            assert got["grads"].keys() == one["grads"].keys()
            for name, grad in one["grads"].items():
                expected, actual = torch.tensor(grad), torch.tensor(got["grads"][name])
                assert expected.abs().max() > 0, (case, name)
                assert (actual - expected).abs().max() <= GRAD_RTOL * expected.abs().max(), (case, name)


def test_an_architecture_that_changes_its_logits_after_the_output_layer_keeps_them() -> None:
    """Gemma 2 soft-caps its logits after the output layer; the chunked path (the output layer alone) would lose that,
    so an architecture outside ``CHUNKED_MODEL_TYPES`` takes the one-pass path: the model's own logits, bit for bit."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=0.5, tie_word_embeddings=False)).eval()
    tokens = torch.randint(0, VOCAB, (2, 3 * CHUNK + 1))
    targets = torch.randint(0, VOCAB, tokens.shape)
    expected = torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, tokens, targets, chunk_tokens=CHUNK), expected)
        plain = torch.log_softmax(model.lm_head(model.model(input_ids=tokens).last_hidden_state).float(), dim=-1)
    assert not torch.allclose(plain.gather(-1, targets[..., None])[..., 0], expected, atol=1e-3)  # the cap matters

"""Peak memory of one training pass of the Tinker server (``forward_backward``: ``token_logprobs``, the
``cross_entropy`` sum, backward) at 4k and 8k tokens with Qwen3's whole 151,936-token vocabulary on a small hidden
size, before and after issue 44 (docs/tinker-server/internals.md, "Training memory: logits and attention").

    python -m ds_bench tinker-logits-memory [--tokens 4096 8192] [--out benchmarks/results/tinker-logits-memory.md]

Paths, each in a fresh process (one sequence, fp32, CPU, one intra-op thread):

- ``before``: the server until issue 44: ``eager`` attention, the model's logits for every position at once, then
  ``log_softmax`` over them (the old ``token_logprobs``, copied here);
- ``chunked``: the server's ``token_logprobs`` (the output layer a chunk of positions at a time, recomputed in
  backward) with ``eager`` attention: what the chunking alone removes;
- ``after``: the server as it is (``token_logprobs`` and its ``ATTN_IMPLEMENTATION``, SDPA).

Memory is the resident set (RSS, ``ds_bench.memory``: glibc made to return freed memory, the peak reset after the
model is built): the pass's own peak is the peak during the pass less the RSS before it. A process given less
address space than a path needs (``--limit-gib``, default: what the machine has available) reports that instead of
pushing the machine into swap or the OOM killer.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

VOCAB = 151_936
#: Small on purpose: the vocabulary terms (logits, their log-softmax and gradients) dominate, as they do at 8k tokens
#: for Qwen3-8B; 2 heads keep eager's T x T attention probabilities visible but below the logits.
MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
PATHS = ("before", "chunked", "after")
MIB = 2**20
RESULTS = Path(__file__).resolve().parents[1] / "results" / "tinker-logits-memory.md"


def _old_token_logprobs(model, tokens, targets):
    """``token_logprobs`` until issue 44: every position's logits at once."""
    import torch

    logits = model(input_ids=tokens).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def measure(path: str, tokens: int) -> dict[str, float]:
    """One pass of ``path`` on ``tokens`` tokens in this process: RSS before, peak during, in MiB."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspeed_tinker.model import ATTN_IMPLEMENTATION, cross_entropy_sum, token_logprobs
    from ds_bench.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss, stabilize_allocator

    stabilize_allocator()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    attention = ATTN_IMPLEMENTATION if path == "after" else "eager"
    model = Qwen3ForCausalLM(Qwen3Config(**MODEL, max_position_embeddings=tokens, attn_implementation=attention))
    ids = torch.randint(0, VOCAB, (1, tokens + 1))
    function = _old_token_logprobs if path == "before" else token_logprobs
    before = current_rss_bytes()
    reset_peak_rss()
    logprobs = function(model, ids[:, :-1], ids[:, 1:])
    cross_entropy_sum(logprobs, torch.ones_like(logprobs)).backward()
    peak = peak_rss_bytes()
    assert model.lm_head.weight.grad is not None
    return {"before_mib": before / MIB, "peak_mib": peak / MIB, "attention": attention}


def _available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _run_one(path: str, tokens: int, limit_bytes: int) -> dict | None:
    """``measure`` in a fresh process with at most ``limit_bytes`` of address space; None if that was not enough."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    out = subprocess.run([sys.executable, "-m", "ds_bench", "tinker-logits-memory", "--one", path, str(tokens)],
                         capture_output=True, text=True, preexec_fn=limit)
    if out.returncode != 0:
        if "memory" in out.stderr.lower() or "alloc" in out.stderr.lower():
            return None
        raise RuntimeError(f"{path} at {tokens} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[int, dict[str, dict | None]], limit_gib: float) -> str:
    def cell(r: dict | None) -> str:
        if r is None:
            return f"> {limit_gib:.0f} GiB (did not fit)"
        return f"{(r['peak_mib'] - r['before_mib']) / 1024:.2f} GiB"

    rows = ["| tokens | fp32 logits (T x V x 4 B) | before (eager, one pass) | chunked, eager "
            "| after (SDPA, chunked) |", "| --- | --- | --- | --- | --- |"]
    for tokens, by_path in results.items():
        rows.append(f"| {tokens:,} | {tokens * VOCAB * 4 / 2**30:.2f} GiB | {cell(by_path['before'])} | "
                    f"{cell(by_path['chunked'])} | {cell(by_path['after'])} |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_bench tinker-logits-memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"the Markdown page (default {RESULTS})")
    parser.add_argument("--limit-gib", type=float, default=None,
                        help="address space per measuring process (default: the memory available now, less 2 GiB)")
    parser.add_argument("--one", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    limit_gib = args.limit_gib or _available_bytes() / 2**30 - 2
    results: dict[int, dict[str, dict | None]] = {}
    for tokens in args.tokens:
        for path in reversed(PATHS):  # the smallest first
            results.setdefault(tokens, {})[path] = _run_one(path, tokens, int(limit_gib * 2**30))
            print(tokens, path, results[tokens][path], flush=True)
    import torch
    import transformers

    page = (f"# Training memory: one forward_backward, vocabulary {VOCAB:,}\n\n"
            f"Generated by `python -m ds_bench tinker-logits-memory` (`benchmarks/ds_bench/tinker_logits_memory.py`; "
            f"the paths are in its docstring). Qwen3, {MODEL['num_hidden_layers']} layers, hidden "
            f"{MODEL['hidden_size']}, {MODEL['num_attention_heads']} heads, untied unembedding; one sequence, fp32, "
            f"CPU, torch {torch.__version__}, transformers {transformers.__version__}. Each cell is the peak resident "
            f"memory of the pass less the resident memory before it (the model and its inputs).\n\n"
            f"{table(results, limit_gib)}\n")
    args.out.write_text(page)
    print(page)

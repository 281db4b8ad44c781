"""Sampling throughput of the Tinker server's sampler, before and after batching (docs/tinker-server/internals.md).

    python -m ds_bench tinker-sampling [--reps 5] [--threads 1] [--json PATH]

One process, no ranks: what a rank runs for ``asample`` requests (generation, then the scoring forward that gives
the logprobs), on the same model, weights, request mix and seeds, through the sampler that was (one request at a
time; ``generate_reference``, the test oracle in tests/tinker_server/sampling_reference.py: every sample decodes
until all are done, one seeded draw at a time, the whole completion re-decoded for stop strings at every token) and
the one that is (``SamplerPool.sample_many``: requests that arrive together in batches of up to 32 requests,
``sampler.generate_batch``). Both give the same tokens and logprobs (checked here on every request, and by
tests/tinker_server/session_servers/test_sampler_batching.py). Repetitions alternate old and new; the median of each
is reported: tokens/s = completion tokens / seconds.

The request mix is an RL step's 64 samples: 8 prompts of 12-40 tokens, up to 64 new tokens, temperature 1,
stopping on 8 of the 256 byte values (as an EOS ends answers at varied lengths), two prompts also on stop strings,
one greedy; sent as 8 requests of 8 samples, and as 64 requests of 1 (tinker-cookbook's per-environment requests);
on ``small-llama-byte`` (4 layers, width 128) with a rank-32 LoRA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

#: The old sampler, kept as the tests' oracle beside them (not part of the server).
REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "tinker_server" / "sampling_reference.py"

LORA = {"rank": 32, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}


def request_mixes(seed: int = 0) -> dict[str, list]:
    """Two ways one RL step's 64 samples arrive: as one request per group (8 prompts x 8 samples), and as one
    request per sample (tinker-cookbook's ``TinkerTokenCompleter`` asks ``num_samples=1`` per environment, and a
    group's environments share their prompt: 64 concurrent requests, 8 prompts)."""
    import numpy as np

    from deepspeed_tinker.sampling import SampleJob, SnapshotRef

    rng = np.random.default_rng(seed)
    stop_tokens = tuple(int(t) for t in rng.choice(256, 8, replace=False))
    ref = SnapshotRef("bench", "small-llama-byte", LORA)
    groups, per_sample = [], []
    for i in range(8):
        prompt = tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(12, 41))))
        seeds = tuple(int(s) for s in rng.integers(0, 2**62, 8))
        params = (64, 0.0 if i == 7 else 1.0, -1, 1.0, stop_tokens, ("ab", "\n\n") if i in (2, 5) else ())
        groups.append(SampleJob(ref, prompt, 8, *params, seeds))
        per_sample += [SampleJob(ref, prompt, 1, *params, (s, )) for s in seeds]
    return {"8 requests x 8 samples": groups, "64 requests x 1 sample": per_sample}


def run(reps: int, threads: int, batch: int) -> dict:
    import importlib.util

    import torch

    from deepspeed_tinker.model import LoraSpec, build_model
    from deepspeed_tinker.sampler import SamplerPool, score

    spec = importlib.util.spec_from_file_location("sampling_reference", REFERENCE)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    generate_reference = reference.generate_reference

    torch.set_num_threads(threads)
    pool = SamplerPool(torch.device("cpu"))
    trained = build_model("small-llama-byte", LoraSpec(**LORA))
    generator = torch.Generator().manual_seed(0)
    pool.keep("bench", {n: torch.randn(p.shape, generator=generator) * 0.05
                        for n, p in trained.named_parameters() if "lora_" in n})

    def before(jobs: list) -> list:
        """The server before: one request at a time, the old decode loop, then the scoring forward."""
        out = []
        for job in jobs:
            module = pool._module(job.snapshot)
            prompt = torch.tensor(job.prompt)
            completions = generate_reference(module, prompt, job, list(job.seeds), pool.decoder("small-llama-byte"))
            out.append(score(module, prompt, completions, 0))
        return out

    def after(jobs: list) -> list:
        """The server now: requests that arrive together run as batches of up to ``batch`` (server.py)."""
        out = []
        for at in range(0, len(jobs), batch):
            chunk = jobs[at:at + batch]
            for status, part in pool.sample_many(chunk, [range(j.num_samples) for j in chunk], False):
                assert status == "ok", part
                out.append(part["sequences"])
        return out

    report: dict = {"model": "small-llama-byte (4 layers, width 128) + LoRA rank 32", "threads": threads,
                    "reps": reps, "batch": batch, "mixes": {}}
    for mix, jobs in request_mixes().items():
        times: dict[str, list[float]] = {"before": [], "after": []}
        outputs: dict[str, list] = {}
        for rep in range(reps + 1):  # the first repetition warms up and is not counted
            for name in (("before", "after") if rep % 2 else ("after", "before")):
                start = time.perf_counter()
                result = (before if name == "before" else after)(jobs)
                elapsed = time.perf_counter() - start
                if rep:
                    times[name].append(elapsed)
                outputs.setdefault(name, [[(s.tokens.tolist(), s.logprobs.tolist(), s.stop_reason) for s in r]
                                          for r in result])
        if outputs["before"] != outputs["after"]:
            raise SystemExit(f"{mix}: the two samplers disagree: not comparable")
        tokens = sum(len(s[0]) for r in outputs["after"] for s in r)
        entry = {"requests": len(jobs), "samples": sum(j.num_samples for j in jobs), "completion_tokens": tokens,
                 "stopped_early": sum(s[2] == "stop" for r in outputs["after"] for s in r)}
        for name in times:
            median = statistics.median(times[name])
            entry[f"{name}_s"] = round(median, 3)
            entry[f"{name}_tokens_per_s"] = round(tokens / median, 1)
        entry["speedup"] = round(entry["before_s"] / entry["after_s"], 2)
        report["mixes"][mix] = entry
    return report


def main(argv: list[str]) -> None:
    """``python -m ds_bench tinker-sampling ARGV``."""
    parser = argparse.ArgumentParser(prog="python -m ds_bench tinker-sampling", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32, help="most requests per batch (server.MAX_SAMPLE_BATCH)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = run(args.reps, args.threads, args.batch)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")

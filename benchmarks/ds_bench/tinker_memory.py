"""Peak memory per rank of the Tinker server's training side: loading a model, then one training step, for ZeRO
1, 2 and 3 at 1, 2 and 4 CPU ranks (docs/tinker-server/deployment.md, "Memory per rank").

    python -m ds_bench tinker-memory [--stages 1 2 3] [--worlds 1 2 4] [--json PATH] [--markdown PATH]
    python -m ds_bench tinker-memory render PATH.json     # the table again from a --json file
    python -m ds_bench tinker-memory --lora-clients 3 --stages 1 3 --worlds 2   # one base, several LoRA clients

The model is a real architecture, randomly initialised and saved with ``save_pretrained`` (a Qwen3: 8 layers,
width 512, MLP 1536, 8 heads / 4 KV heads, vocabulary 32768, untied unembedding: 58 M parameters, 233 MB in fp32),
served as ``--base-model`` is: each rank runs the server's own ``Worker`` (the same code as ``serve``), creates a
full fine-tuning client (rank 0: ZeRO partitions the gradients and Adam state of every weight; under ZeRO-3 the
model is built and loaded sharded with ``deepspeed.zero.Init``), then runs one ``forward_backward`` (4 datums of 128
tokens, split over the ranks) and one ``optim_step``. fp32, gloo, one intra-op thread per rank.

Memory is the resident set (RSS) of each rank process: after imports and ``init_process_group`` (the baseline),
the peak while ``create`` loads the model and builds the engine, and the peak during the step (reset in between;
``ds_bench.memory``: ``/proc/self/clear_refs``, glibc's allocator made to return freed memory, so the peak follows
live memory). The table gives the largest rank's figures (rank 0, which also reads the checkpoint file under ZeRO-3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODEL = dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)
MIB = 2**20


def build_model_dir(directory: Path) -> Path:
    """The random-init Qwen3 (seed 0), saved once."""
    if not (directory / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, Qwen3Config

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3Config(**MODEL)).save_pretrained(str(directory))
    return directory.resolve()


def rank_main(out: Path, stage: int, model_dir: str, lora_clients: int = 0) -> None:
    from ds_bench.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss, stabilize_allocator

    stabilize_allocator()

    import numpy as np
    import torch
    import torch.distributed as dist

    from local_ranks.ranks import init_gloo_deepspeed

    torch.set_num_threads(1)
    init_gloo_deepspeed(timeout_minutes=30)
    from deepspeed_tinker.api import ModelRecord
    from deepspeed_tinker.commands import run_command
    from deepspeed_tinker.jobs import AdamParams, JobKind
    from deepspeed_tinker.model import register_local_model
    from deepspeed_tinker.wire import Datum, FwdBwdRequest
    from deepspeed_tinker.worker import Worker

    spec = register_local_model(model_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    worker = Worker(rank, world, stage)
    dist.barrier()
    baseline = current_rss_bytes()
    if lora_clients:  # resident memory after each LoRA client of the same base model is created
        from deepspeed_tinker.model import LoraSpec

        after = []
        for i in range(lora_clients):
            record = ModelRecord(f"lora{i}", "s", spec.name, LoraSpec(rank=32, seed=i))
            run_command(worker, JobKind.CREATE, f"lora{i}", record)
            dist.barrier()
            after.append(current_rss_bytes())
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "baseline": baseline, "after": after}))
        dist.destroy_process_group()
        return
    reset_peak_rss()
    start = time.perf_counter()
    run_command(worker, JobKind.CREATE, "m", ModelRecord("m", "s", spec.name, None))
    dist.barrier()
    load_s, load_peak = time.perf_counter() - start, peak_rss_bytes()
    engine = worker.models["m"].engine
    held = sum(int(p.ds_tensor.numel()) + int(p.numel()) if hasattr(p, "ds_tensor") else int(p.numel())
               for p in engine.module.parameters())
    total = sum(int(p.ds_numel) if hasattr(p, "ds_numel") else int(p.numel()) for p in engine.module.parameters())
    rng = np.random.default_rng(0)
    data = tuple(Datum(t[:-1], t[1:], np.ones(len(t) - 1, np.float32))
                 for t in (rng.integers(0, MODEL["vocab_size"], 129).astype(np.int64) for _ in range(4)))
    reset_peak_rss()
    start = time.perf_counter()
    run_command(worker, JobKind.FORWARD_BACKWARD, "m", FwdBwdRequest("m", 0, "cross_entropy", False, data))
    run_command(worker, JobKind.OPTIM_STEP, "m", AdamParams(eps=1e-8))
    dist.barrier()
    step_s, step_peak = time.perf_counter() - start, peak_rss_bytes()
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "baseline": baseline, "load_peak": load_peak, "step_peak": step_peak, "load_s": load_s,
        "step_s": step_s, "params_held": held, "params_total": total}))
    dist.destroy_process_group()


def run_config(stage: int, world: int, model_dir: Path, scratch: Path, lora_clients: int = 0) -> list[dict]:
    from local_ranks.ranks import start_ranks

    out = scratch / (f"zero{stage}-w{world}" + (f"-lora{lora_clients}" if lora_clients else ""))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    procs = start_ranks([sys.executable, "-m", "ds_bench", "tinker-memory", "rank", str(out), str(stage),
                         str(model_dir),
                         str(lora_clients)], world, cpu=True,
                        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, cwd=ROOT, log_dir=out)
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ZeRO-{stage} x {world}: ranks exited {codes}; logs in {out}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def markdown(results: list[dict]) -> str:
    """The table: per configuration, the share of the weights a rank holds after loading, and peak RSS per rank
    (rank 0, which reads the checkpoint file under ZeRO-3, and the largest other rank) while loading and in the step,
    with the baseline every rank has after imports."""
    lines = ["| ZeRO | ranks | weights held per rank | load: peak RSS, rank 0 / others | step: peak RSS per rank | "
             "above the baseline: load (rank 0) / step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        ranks = r["ranks"]
        base = max(x["baseline"] for x in ranks)
        others = max((x["load_peak"] for x in ranks[1:]), default=None)
        held = max(x["params_held"] for x in ranks) / ranks[0]["params_total"]
        step = max(x["step_peak"] for x in ranks)
        load = f"{ranks[0]['load_peak'] / MIB:,.0f}" + (f" / {others / MIB:,.0f}" if others is not None else "")
        lines.append(f"| {r['stage']} | {r['world']} | {held:.0%} | {load} MiB | {step / MIB:,.0f} MiB | "
                     f"{(ranks[0]['load_peak'] - base) / MIB:,.0f} / {(step - base) / MIB:,.0f} MiB |")
    baseline = max(x["baseline"] for r in results for x in r["ranks"])
    return "\n".join(lines) + (f"\n\nBaseline (every rank, after imports and init_process_group): "
                               f"{baseline / MIB:,.0f} MiB.\n")


def main(argv: list[str]) -> None:
    """``python -m ds_bench tinker-memory ARGV``; ``rank ...`` is how the measurement starts its ranks."""
    if argv[:1] == ["rank"]:
        rank_main(Path(argv[1]), int(argv[2]), argv[3], int(argv[4]) if len(argv) > 4 else 0)
        from local_ranks.ranks import exit_rank

        exit_rank(0)
    if len(argv) > 1 and argv[0] == "render":  # the table again from a --json file
        print(markdown(json.loads(Path(argv[1]).read_text())["results"]))
        return
    parser = argparse.ArgumentParser(prog="python -m ds_bench tinker-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--scratch", type=Path, default=ROOT / "scratch" / "tinker_memory")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--lora-clients", type=int, default=0,
                        help="instead: resident memory per rank after each of N LoRA clients (rank 32) of the model")
    args = parser.parse_args(argv)
    model_dir = build_model_dir(args.scratch / "qwen3-58m")
    if args.lora_clients:
        header = " | ".join(f"after LoRA client {i + 1}" for i in range(args.lora_clients))
        rows = [f"| ZeRO | ranks | {header} |", "| --- | --- |" + " --- |" * args.lora_clients]
        for stage in args.stages:
            for world in args.worlds:
                ranks = run_config(stage, world, model_dir, args.scratch, args.lora_clients)
                top = [max(r["after"][i] - r["baseline"] for r in ranks) for i in range(args.lora_clients)]
                rows.append(f"| {stage} | {world} | " + " | ".join(f"+{t / MIB:,.0f} MiB" for t in top) + " |")
                print(rows[-1], flush=True)
        print("\n".join(rows))
        return
    results = []
    for stage in args.stages:
        for world in args.worlds:
            started = time.perf_counter()
            ranks = run_config(stage, world, model_dir, args.scratch)
            results.append({"stage": stage, "world": world, "ranks": ranks})
            print(f"ZeRO-{stage} x {world}: step peak {max(r['step_peak'] for r in ranks) / MIB:,.0f} MiB per rank "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"model": MODEL, "results": results}, indent=1) + "\n")
    table = markdown(results)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)

"""The Tinker server's two samplers side by side in one run: the ranks' own (``--sampler native``) and vLLM
(``--sampler vllm``), same model, same machine (docs/tinker-server/sampling.md shows the result).

    python -m ds_bench tinker-samplers [--vllm-python PATH] [--out benchmarks/results/tinker-samplers.md]

For each sampler a 2-rank ZeRO-1 server on CPU ranks serves a tiny Qwen3 (hidden 64, 2 layers, vocabulary ~270), and
a LoRA client (rank 8) trains it a few steps, then through the SDK:

- **throughput**: 1, 8 and 32 concurrent ``sample`` requests of one 64-token completion each (temperature 1, no stop,
  so every completion is 64 tokens), repeated for 8 s per level after a warm-up; tokens/s = completion tokens / wall
  time;
- **a training step beside rollouts**: the median time of ``forward_backward`` + ``optim_step`` (8 datums of 64
  tokens) alone, and while another client keeps 8 sampling requests in flight;
- **the logprob gap** (vLLM only): for 64 sampled sequences, vLLM's logprob of each sampled token against the
  trainer's forward of the same sequence (mean and max |delta|, and the sampled-token KL estimate mean(delta));
- **tinker-cookbook's rl_basic**: the median time of a step (``time/total``) over 4 steps (4 groups of 4 rollouts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
CHAT_LETTERS = Path(__file__).resolve().parents[2] / "examples" / "tinker" / "chat_letters.py"
QWEN = "Qwen/Qwen3-8B"
KEY = "tml-bench"
COMPLETION_TOKENS = 64
CONCURRENCY = (1, 8, 32)
SECONDS_PER_LEVEL = 8.0


def _server(tmp: Path, model_dir: Path, sampler: str, vllm_python: str | None) -> Any:
    from deepspeed_tinker.launch import ServerProcess

    tmp.mkdir(parents=True, exist_ok=True)
    keys = tmp / "keys"
    keys.write_text(KEY + "\n")
    extra = ["--device", "cpu", "--api-keys-file", str(keys), "--base-model", f"{QWEN}={model_dir}",
             "--sampler", sampler, "--no-access-log", "--long-poll-s", "1"]
    if sampler == "vllm":
        extra += ["--vllm-python", vllm_python or ""]
    server = ServerProcess(world_size=2, zero_stage=1, checkpoint_dir=tmp / "ckpt", extra_args=extra,
                           log_path=tmp / f"server-{sampler}.log")
    server.start(timeout_s=600)
    return server


def _datum(tokens: list[int]) -> Any:
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _batch(seed: int) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [_datum([int(t) for t in rng.integers(0, 256, COMPLETION_TOKENS + 1)]) for _ in range(8)]


def _step(training: Any, batch: list) -> float:
    from tinker import types

    start = time.perf_counter()
    training.forward_backward(batch, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return time.perf_counter() - start


async def _throughput(client: Any, concurrency: int, seconds: float) -> float:
    from tinker import types

    params = types.SamplingParams(max_tokens=COMPLETION_TOKENS, temperature=1.0, stop=[])
    prompt = types.ModelInput.from_ints(list(range(10, 26)))
    tokens = 0
    deadline = time.perf_counter() + seconds

    async def worker(seed: int) -> None:
        nonlocal tokens
        while time.perf_counter() < deadline:
            seeded = types.SamplingParams(**{**params.model_dump(), "seed": seed})
            result = await client.sample(prompt, 1, seeded)
            tokens += sum(len(s.tokens) for s in result.sequences)
            seed += 1000

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return tokens / (time.perf_counter() - start)


def _logprob_gap(training: Any, client: Any, samples: int) -> dict[str, float]:
    import numpy as np
    from tinker import types

    prompt = list(range(30, 42))
    params = types.SamplingParams(max_tokens=COMPLETION_TOKENS, temperature=1.0, stop=[], seed=7)
    result = client.sample(types.ModelInput.from_ints(prompt), samples, params).result()
    deltas = []
    for sequence in result.sequences:
        tokens = prompt + list(sequence.tokens)
        out = training.forward([_datum(tokens)], "cross_entropy").result()
        trainer = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())[len(prompt) - 1:]
        deltas.append(np.asarray(sequence.logprobs) - trainer)
    delta = np.concatenate(deltas)
    return {"tokens": int(delta.size), "mean_abs": float(np.abs(delta).mean()), "max_abs": float(np.abs(delta).max()),
            "kl_estimate": float(delta.mean())}


def _rl_basic(base_url: str, model_dir: Path, log_dir: Path) -> float:
    import importlib.util

    from transformers import AutoTokenizer

    # The letters task of the demos' clients (examples/tinker/, not a package), by name: chz finds its classes so.
    spec = importlib.util.spec_from_file_location("chat_letters", CHAT_LETTERS)
    chat_letters = sys.modules["chat_letters"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chat_letters)
    ChatLettersDatasetBuilder = chat_letters.ChatLettersDatasetBuilder
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.recipes import rl_basic

    tokenizer_utils.register_tokenizer(QWEN, lambda: AutoTokenizer.from_pretrained(str(model_dir)))
    config = rl_basic.build_config_blueprint(QWEN).apply({
        "dataset_builder": ChatLettersDatasetBuilder(renderer_name="role_colon", model_name_for_tokenizer=QWEN,
                                                     batches=4, batch_size=4, group_size=4, max_tokens=16),
        "base_url": base_url, "log_path": str(log_dir), "learning_rate": 3e-2, "lora_rank": 8, "max_tokens": 16,
        "num_groups_to_log": 0, "rollout_json_export": False, "save_every": 0}).make()
    rl_basic.main(config)
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(row["time/total"] for row in rows if "time/total" in row)


def measure(sampler: str, model_dir: Path, tmp: Path, vllm_python: str | None) -> dict[str, Any]:
    import tinker

    server = _server(tmp / sampler, model_dir, sampler, vllm_python)
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        training = service.create_lora_training_client(base_model=QWEN, rank=8, seed=1).result(timeout=300)
        for i in range(3):
            _step(training, _batch(i))
        client = training.save_weights_and_get_sampling_client().result(timeout=300)
        asyncio.run(_throughput(client, 4, 2.0))  # warm-up
        report: dict[str, Any] = {"tokens_per_s": {c: asyncio.run(_throughput(client, c, SECONDS_PER_LEVEL))
                                                   for c in CONCURRENCY}}
        alone = [_step(training, _batch(10 + i)) for i in range(4)]
        stop = threading.Event()

        def rollouts() -> None:
            other = service.create_sampling_client(base_model=QWEN).result(timeout=120)

            async def loop() -> None:
                while not stop.is_set():
                    await _throughput(other, 8, 1.0)

            asyncio.run(loop())

        thread = threading.Thread(target=rollouts, daemon=True)
        thread.start()
        time.sleep(2.0)
        beside = [_step(training, _batch(20 + i)) for i in range(4)]
        stop.set()
        thread.join(timeout=60)
        report["train_step_s"] = {"alone": statistics.median(alone), "beside_rollouts": statistics.median(beside)}
        if sampler == "vllm":
            client = training.save_weights_and_get_sampling_client().result(timeout=300)
            report["logprob_gap"] = _logprob_gap(training, client, 64)
        report["rl_basic_step_s"] = _rl_basic(server.base_url, model_dir, tmp / sampler / "rl_basic")
        return report
    finally:
        server.stop(timeout_s=120)


def render(report: dict[str, Any]) -> str:
    native, vllm = report["native"], report["vllm"]
    lines = ["# The Tinker server's samplers side by side", "",
             f"`python -m ds_bench tinker-samplers` on {report['machine']}, {report['date']}: a 2-rank ZeRO-1 server "
             "on CPU ranks, a tiny Qwen3 (hidden 64, 2 layers), a rank-8 LoRA snapshot; vLLM "
             f"{report['vllm_version']} with 1 CPU thread beside the ranks. See the module's docstring for what each "
             "row measures.", "",
             "| | native (the ranks) | vLLM |", "| --- | ---: | ---: |"]
    for c in CONCURRENCY:
        lines.append(f"| SDK sampling, {c} concurrent request(s), tokens/s | {native['tokens_per_s'][c]:.0f} | "
                     f"{vllm['tokens_per_s'][c]:.0f} |")
    for key, label in (("alone", "a training step (8 x 64 tokens) alone, s"),
                       ("beside_rollouts", "the same step while another client samples (8 in flight), s")):
        lines.append(f"| {label} | {native['train_step_s'][key]:.2f} | {vllm['train_step_s'][key]:.2f} |")
    lines.append(f"| tinker-cookbook rl_basic, median step (`time/total`), s | {native['rl_basic_step_s']:.2f} | "
                 f"{vllm['rl_basic_step_s']:.2f} |")
    gap = vllm["logprob_gap"]
    lines += ["", f"vLLM's logprobs against the trainer's forward, {gap['tokens']} sampled tokens (fp32 on both "
              f"sides): mean |delta| {gap['mean_abs']:.2e}, max |delta| {gap['max_abs']:.2e}, sampled-token KL "
              f"estimate mean(delta) {gap['kl_estimate']:.2e}.", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_bench tinker-samplers")
    parser.add_argument("--vllm-python", default=os.environ.get("DEEPSPEED_TINKER_VLLM_PYTHON"))
    parser.add_argument("--out", type=Path, default=RESULTS / "tinker-samplers.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ["TINKER_API_KEY"] = KEY  # tinker-cookbook's clients read it there
    import subprocess

    from deepspeed_tinker.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = build_tiny_model(tmp / "qwen3-h64", "qwen3", hidden_size=64)
        report: dict[str, Any] = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)", "date": time.strftime("%Y-%m-%d"),
            "vllm_version": subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                           capture_output=True, text=True, cwd="/tmp").stdout.strip()}
        for sampler in ("native", "vllm"):
            report[sampler] = measure(sampler, model_dir, tmp, args.vllm_python)
            print(json.dumps({sampler: report[sampler]}), flush=True)
    args.out.write_text(render(report))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(render(report))

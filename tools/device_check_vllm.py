"""The Tinker server with vLLM on one CUDA GPU, a model of a real size: serve, train through the SDK, sample, measure.

    python3 tools/device_check_vllm.py [REPORT.md]            # on the GPU machine: Qwen3, about 1.1B parameters
    python3 tools/device_check_vllm.py REPORT.md --tiny       # the same steps on a tiny model, CPU (the suite runs it)

Nothing can be downloaded on the GPU machine, so the model is a Qwen3 configuration of about 1.1B parameters
(hidden 1536, 24 layers, 12 heads of 128, 4 KV heads, MLP 4608, vocabulary 151,936, untied), randomly initialised and
saved here in bf16, with the tiny chat tokenizer of ``deepspeed_tinker.tiny_models``. One rank trains it (bf16,
ZeRO-1) beside vLLM on the same GPU (``--sampler vllm``: vLLM takes 30 % of its memory). Through the SDK a rank-32 LoRA
client trains 3 steps of 4 datums x 512 tokens (the step time), saves a snapshot and samples 32 concurrent requests x
128 tokens from it (tokens/s); the rank's peak GPU memory comes from the server's ``/metrics``. vLLM runs from the
Python in ``$DEEPSPEED_TINKER_VLLM_PYTHON`` (default: this one), which must import vllm; the whole check is bounded
to 8 minutes. The report is one Markdown table; the exit status is 1 if a step failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "Qwen/Qwen3-1B-random"
KEY = "tml-device-check"
BUDGET_S = 480
REAL = {"hidden_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 12, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 4608, "vocab_size": 151936, "max_position_embeddings": 4096}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024}


def build_model(directory: Path, shape: dict[str, int], dtype: str) -> tuple[Path, int]:
    """A randomly initialised Qwen3 of ``shape`` with the tiny chat tokenizer; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from deepspeed_tinker.tiny_models import chat_tokenizer

    tokenizer = chat_tokenizer("qwen3")
    ids = {n: tokenizer.convert_tokens_to_ids(t) if t else None
           for n, t in (("bos", tokenizer.bos_token), ("eos", tokenizer.eos_token))}
    config = Qwen3Config(**shape, tie_word_embeddings=False, bos_token_id=ids["bos"], eos_token_id=ids["eos"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, sum(p.numel() for p in model.parameters())


def peak_device_memory(base_url: str) -> float | None:
    """The rank's GPU memory allocated (``tinker_rank_memory_bytes{kind="device_allocated"}``), GiB."""
    request = urllib.request.Request(base_url + "/metrics", headers={"X-API-Key": KEY})
    text = urllib.request.urlopen(request, timeout=30).read().decode()
    found = re.findall(r'tinker_rank_memory_bytes\{[^}]*kind="device_allocated"[^}]*\} ([0-9.e+]+)', text)
    return max(float(v) for v in found) / 2**30 if found else None


def run(report: list[tuple[str, str, str]], tiny: bool, work: Path) -> None:
    import tinker
    from tinker import types

    from deepspeed_tinker.launch import ServerProcess

    device, dtype = ("cpu", "fp32") if tiny else ("cuda", "bf16")
    started = time.perf_counter()
    model_dir, params = build_model(work / "model", TINY if tiny else REAL, "float32" if tiny else "bfloat16")
    report.append(("model", "ok", f"Qwen3, {params / 1e9:.2f}B parameters, random weights ({dtype})"))
    keys = work / "keys"
    keys.write_text(KEY + "\n")
    vllm_python = os.environ.get("DEEPSPEED_TINKER_VLLM_PYTHON") or sys.executable
    server = ServerProcess(world_size=1, zero_stage=1, checkpoint_dir=work / "ckpt", log_path=work / "server.log",
                           extra_args=["--device", device, "--dtype", dtype, "--api-keys-file", str(keys),
                                       "--base-model", f"{NAME}={model_dir}", "--sampler", "vllm", "--vllm-python",
                                       vllm_python, "--no-access-log"])
    server.start(timeout_s=300)
    try:
        report.append(("server with vLLM", "ok", f"up {time.perf_counter() - started:.0f} s after the start"))
        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        training = service.create_lora_training_client(base_model=NAME, rank=32, seed=1).result(timeout=300)
        tokens = 64 if tiny else 512
        batch = [types.Datum(model_input=types.ModelInput.from_ints([(7 * i + j) % 200 + 10 for j in range(tokens)]),
                             loss_fn_inputs={"target_tokens": [(7 * i + j + 1) % 200 + 10 for j in range(tokens)],
                                             "weights": [1.0] * tokens}) for i in range(4)]
        times = []
        for _ in range(3):
            start = time.perf_counter()
            training.forward_backward(batch, "cross_entropy").result(timeout=300)
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=300)
            times.append(time.perf_counter() - start)
        later = ", ".join(f"{t:.2f}" for t in times[1:])
        report.append((f"training step (LoRA 32, 4 x {tokens} tokens)", "ok",
                       f"first {times[0]:.2f} s, then {later} s"))
        client = training.save_weights_and_get_sampling_client().result(timeout=300)
        params = types.SamplingParams(max_tokens=16 if tiny else 128, temperature=1.0, stop=[])
        prompt = types.ModelInput.from_ints(list(range(10, 42)))
        client.sample(prompt, 1, params).result(timeout=300)  # the adapter registered, vLLM warm

        async def burst() -> int:
            results = await asyncio.gather(*(client.sample(prompt, 1, params) for _ in range(32)))
            return sum(len(s.tokens) for r in results for s in r.sequences)

        start = time.perf_counter()
        sampled = asyncio.run(burst())
        report.append(("sampling on vLLM (32 concurrent)", "ok",
                       f"{sampled / (time.perf_counter() - start):.0f} tokens/s ({sampled} tokens)"))
        memory = peak_device_memory(server.base_url)
        report.append(("rank's GPU memory allocated", "ok", "n/a on CPU" if memory is None else f"{memory:.1f} GiB"))
    finally:
        server.stop(timeout_s=120)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", nargs="?", default=os.path.join(os.environ.get("OUT", "."), "device-check-vllm.md"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: the check's own test")
    parser.add_argument("--work", type=Path, default=Path("/tmp/device-check-vllm"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    report: list[tuple[str, str, str]] = []
    ok = True

    def out_of_time(*_: object) -> None:
        raise TimeoutError(f"the check ran past its {BUDGET_S} s")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(BUDGET_S)
    try:
        run(report, args.tiny, args.work)
    except Exception as e:
        ok = False
        report.append(("failed", "FAIL", f"{type(e).__name__}: {e}".replace("\n", " ")[:500]))
        traceback.print_exc()
    lines = ["| step | result | detail |", "| --- | --- | --- |", *(f"| {a} | {b} | {c} |" for a, b, c in report)]
    Path(args.report).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

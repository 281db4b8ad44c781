"""What the service costs and how it shares the ranks, measured on a tiny Qwen3 (docs/tinker-server/service.md).

    python examples/tinker/service_bench.py overhead   # SDK step vs the same step in-process on the engine
    python examples/tinker/service_bench.py threads    # step-time spread: 1 torch thread per rank vs torch's default
    python examples/tinker/service_bench.py chunks     # datums per forward_backward request vs throughput
    python examples/tinker/service_bench.py fairness   # a trainer's step latency alone and beside a sampler

Each starts its own server(s) on CPU ranks (``deepspeed-tinker serve``, as a user would) and prints one JSON line
per measurement. The step is what issue 34 measured: LoRA rank 8, 8 datums of 64 tokens, ``forward_backward`` +
``optim_step``, both results awaited.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from deepspeed_tinker.commands import run_command
from deepspeed_tinker.jobs import JobKind

API_KEY = "tml-bench"
MODEL = "Qwen/Qwen3-8B"


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(times), "median_s": round(statistics.median(times), 4), "p10_s": round(pick(0.1), 4),
            "p90_s": round(pick(0.9), 4), "min_s": round(ordered[0], 4), "max_s": round(ordered[-1], 4)}


def tiny_qwen3(root: Path) -> Path:
    from deepspeed_tinker.tiny_models import build_tiny_model

    return build_tiny_model(root / "qwen3", "qwen3")


def start(root: Path, name: str, model: Path, world_size: int, *extra: str):
    from deepspeed_tinker.launch import ServerProcess

    keys = root / "api-keys"
    keys.write_text(API_KEY + "\n")
    server = ServerProcess(world_size=world_size, zero_stage=1, checkpoint_dir=root / f"ckpt-{name}",
                           extra_args=["--device", "cpu", "--base-model", f"{MODEL}={model}", "--api-keys-file",
                                       str(keys), "--no-access-log", *extra], log_path=root / f"{name}.log")
    server.start()
    return server


def batch(rng: np.random.Generator, datums: int, length: int = 64) -> list:
    from tinker import types

    out = []
    for _ in range(datums):
        tokens = rng.integers(0, 200, length + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:]}))
    return out


class SdkTrainer:
    """A LoRA training client of a served model, stepping through the SDK."""

    def __init__(self, base_url: str, datums: int = 8, per_request: int | None = None) -> None:
        import tinker
        from tinker import types

        self.service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
        self.training = self.service.create_lora_training_client(MODEL, rank=8).result()
        self.data = batch(np.random.default_rng(0), datums)
        self.per_request = per_request or datums
        self.adam = types.AdamParams(learning_rate=1e-4)

    def step(self) -> float:
        """Seconds for one step: ``forward_backward`` (in requests of ``per_request`` datums) + ``optim_step``."""
        started = time.perf_counter()
        calls = [self.training.forward_backward(self.data[j:j + self.per_request], "cross_entropy")
                 for j in range(0, len(self.data), self.per_request)]
        step = self.training.optim_step(self.adam)
        for call in calls:
            call.result()
        step.result()
        return time.perf_counter() - started

    def close(self) -> None:
        self.service.close("success").result(timeout=30)


def sdk_steps(base_url: str, steps: int, datums: int = 8, per_request: int | None = None,
              warmup: int = 3) -> list[float]:
    trainer = SdkTrainer(base_url, datums, per_request)
    times = [trainer.step() for _ in range(warmup + steps)][warmup:]
    trainer.close()
    return times


class RawHttpTrainer:
    """The same step over plain HTTP on one kept-alive connection (no SDK): the server's share of the overhead."""

    def __init__(self, base_url: str, datums: int = 8) -> None:
        import http.client
        from urllib.parse import urlparse

        from tinker import types
        from tinker.proto.request_conv import forward_backward_request_to_proto

        url = urlparse(base_url)
        self.connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        session = self.post("create_session", {})["session_id"]
        created = self.post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": MODEL,
                                             "lora_config": {"rank": 8}})
        self.model_id = created["model_id"]
        self.wait(created["request_id"])
        self.data = batch(np.random.default_rng(0), datums)
        self.seq = 0
        self.request = lambda seq: forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=self.data, loss_fn="cross_entropy"),
            model_id=self.model_id, seq_id=seq)).SerializeToString()

    def post(self, route: str, body: Any, content_type: str = "application/json") -> dict[str, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.connection.request("POST", f"/api/v1/{route}", data, {"X-API-Key": API_KEY,
                                                                   "Content-Type": content_type})
        return json.loads(self.connection.getresponse().read())

    def wait(self, request_id: str) -> dict[str, Any]:
        while (reply := self.post("retrieve_future", {"request_id": request_id})).get("type") == "try_again":
            pass
        return reply

    def step(self) -> float:
        started = time.perf_counter()
        self.seq += 2
        forward_backward = self.post("forward_backward", self.request(self.seq - 1), "application/x-protobuf")
        step = self.post("optim_step", {"model_id": self.model_id, "seq_id": self.seq,
                                        "adam_params": {"learning_rate": 1e-4}})
        self.wait(forward_backward["request_id"])
        self.wait(step["request_id"])
        return time.perf_counter() - started


class InProcessTrainer:
    """The same step on the engine in this process (one rank, one thread): no HTTP, no futures, no broadcast."""

    def __init__(self, model: Path, datums: int = 8) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", DS_ACCELERATOR="cpu")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        import deepspeed

        from deepspeed_tinker.api import ModelRecord, _adam_params
        from deepspeed_tinker.model import LoraSpec, register_local_model
        from deepspeed_tinker.wire import Datum, FwdBwdRequest
        from local_ranks.ranks import disable_cpu_shm_allreduce

        disable_cpu_shm_allreduce()
        deepspeed.init_distributed(dist_backend="gloo")
        register_local_model(f"{MODEL}={model}")
        from deepspeed_tinker.worker import Worker

        self.worker = Worker(0, 1, 1)
        run_command(self.worker, JobKind.CREATE, "m", ModelRecord("m", "s", MODEL, LoraSpec(rank=8, seed=0)))
        rng = np.random.default_rng(0)
        data = []
        for _ in range(datums):
            tokens = rng.integers(0, 200, 65)
            data.append(Datum(tokens[:-1].astype(np.int64), tokens[1:].astype(np.int64), np.ones(64, np.float32)))
        self.request = FwdBwdRequest("m", 1, "cross_entropy", False, tuple(data))
        self.adam = _adam_params({"adam_params": {"learning_rate": 1e-4}})

    def step(self) -> float:
        started = time.perf_counter()
        run_command(self.worker, JobKind.FORWARD_BACKWARD, "m", self.request)
        run_command(self.worker, JobKind.OPTIM_STEP, "m", self.adam)
        return time.perf_counter() - started


def overhead(root: Path, model: Path, steps: int) -> None:
    """One rank each, one thread each, the same model and step, measured alternately (step for step, so both see
    the same load on a shared machine); then the SDK step on 2 ranks."""
    server = start(root, "overhead-w1", model, 1, "--threads-per-rank", "1")
    try:
        sdk, raw, local = SdkTrainer(server.base_url), RawHttpTrainer(server.base_url), InProcessTrainer(model)
        for _ in range(3):
            sdk.step(), raw.step(), local.step()
        rounds = [(sdk.step(), raw.step(), local.step()) for _ in range(steps)]
        sdk.close()
    finally:
        server.stop()
    for index, what in enumerate(("sdk_step", "raw_http_step", "in_process_step")):
        print(json.dumps({"what": what, "world_size": 1, **summary([r[index] for r in rounds])}), flush=True)
    print(json.dumps({"what": "sdk_minus_in_process", **summary([r[0] - r[2] for r in rounds])}), flush=True)
    print(json.dumps({"what": "raw_http_minus_in_process", **summary([r[1] - r[2] for r in rounds])}), flush=True)
    server = start(root, "overhead-w2", model, 2, "--threads-per-rank", "1")
    try:
        print(json.dumps({"what": "sdk_step", "world_size": 2, **summary(sdk_steps(server.base_url, steps))}),
              flush=True)
    finally:
        server.stop()


def threads(root: Path, model: Path, steps: int) -> None:
    for count in (1, os.cpu_count() or 2):  # torch's default: every core in every rank
        server = start(root, f"threads-{count}", model, 2, "--threads-per-rank", str(count))
        try:
            print(json.dumps({"what": "sdk_step", "threads_per_rank": count,
                              **summary(sdk_steps(server.base_url, steps))}), flush=True)
        finally:
            server.stop()


def chunks(root: Path, model: Path, steps: int) -> None:
    server = start(root, "chunks", model, 2, "--threads-per-rank", "1", "--max-chunk-datums", "1024")
    try:
        for per_request in (1, 4, 8, 16, 32, 64):
            times = sdk_steps(server.base_url, steps, datums=64, per_request=per_request, warmup=1)
            print(json.dumps({"what": "step_of_64_datums", "datums_per_request": per_request, **summary(times),
                              "datums_per_s": round(64 / statistics.median(times), 1)}), flush=True)
    finally:
        server.stop()


def fairness(root: Path, model: Path, steps: int) -> None:
    import tinker
    from tinker import types

    server = start(root, "fairness", model, 2, "--threads-per-rank", "1")
    try:
        print(json.dumps({"what": "trainer_step_alone", **summary(sdk_steps(server.base_url, steps))}), flush=True)
        stop = threading.Event()
        sampled = [0]

        def sampler() -> None:
            service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
            client = service.create_sampling_client(base_model=MODEL).result()
            prompt = types.ModelInput.from_ints(list(range(10, 30)))
            while not stop.is_set():  # 16 long completions at a time, as an RL rollout would
                futures = [client.sample(prompt, 1, types.SamplingParams(max_tokens=128, stop=[], seed=i))
                           for i in range(16)]
                for future in futures:
                    sampled[0] += len(future.result().sequences[0].tokens)
            service.close("success").result(timeout=30)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        time.sleep(5)
        started, before = time.perf_counter(), sampled[0]
        times = sdk_steps(server.base_url, steps)
        rate = (sampled[0] - before) / (time.perf_counter() - started)
        stop.set()
        thread.join(timeout=300)
        print(json.dumps({"what": "trainer_step_beside_sampler", **summary(times),
                          "sampler_tokens_per_s": round(rate, 1)}), flush=True)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["overhead", "threads", "chunks", "fairness"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    model = tiny_qwen3(root)
    run = {"overhead": overhead, "threads": threads, "chunks": chunks, "fairness": fairness}[args.what]
    run(root, model, args.steps)


if __name__ == "__main__":
    main()

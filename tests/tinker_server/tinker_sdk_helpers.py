"""Shared by the end-to-end tests: raw HTTP on loopback, random data, a plain-PyTorch replay."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from deepspeed_tinker.api import checkpoint_dir, parse_tinker_path
from deepspeed_tinker.checkpoint_files import read_weights
from deepspeed_tinker.model import LoraSpec, build_model, cross_entropy_sum, token_logprobs


def require(module: str) -> Any:
    """Import a dependency from requirements/tinker-server.txt: skip without it, but fail in CI,
    where a skip would hide a missing install step."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason="install requirements/tinker-server.txt")


#: vLLM's own Python, for ``serve --sampler vllm`` (tools/vllm-env.sh builds it; tools/test.sh exports it).
VLLM_PYTHON = os.environ.get("DEEPSPEED_TINKER_VLLM_PYTHON", "")
#: The tests that serve with vLLM skip without its environment.
requires_vllm = pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                                   reason="no vLLM environment (bash tools/vllm-env.sh; tools/test.sh sets "
                                   "DEEPSPEED_TINKER_VLLM_PYTHON)")


#: The demos' clients (examples, not part of the installed server).
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tinker"


def load_example(name: str) -> Any:
    """One of the demos' client scripts (``examples/tinker/<name>.py``) as a module, loaded from its file."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # by name, as if run: chz and pickle find its classes
    spec.loader.exec_module(module)
    return module


API_KEY = "tml-test"
#: Hugging Face names tinker-cookbook's model tables know -> the ``tiny_models`` family the session's servers serve
#: under that name (``--base-model NAME=PATH``): the cookbook picks the ``qwen3`` and ``role_colon`` renderers.
CHAT_MODELS = {"Qwen/Qwen3-8B": "qwen3", "meta-llama/Llama-3.1-8B": "llama"}
NAMED_MODEL = "Qwen/Qwen3-8B"
RESULT_TIMEOUT_S = 120
#: Generous: a loaded 2-core machine can take a minute to import torch and DeepSpeed on 2 ranks.
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 120


@functools.cache
def unmanaged_stage_supported(stage: int) -> bool:
    """Whether the installed DeepSpeed accepts the server's config at this ZeRO stage."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    from deepspeed_tinker.worker import ds_config

    try:
        DeepSpeedConfig(ds_config(stage))
    except DeepSpeedConfigError:
        return False
    return True


def start_server(tmp_dir: Path, zero_stage: int, checkpoint_dir: Path | None = None, base_models: tuple = (),
                 extra_args: tuple[str, ...] = (), world_size: int = 2):
    """A ``world_size``-rank server (default 2) on loopback with short long-polls, accepting the API key ``API_KEY``
    only (from a keys file), serving ``base_models`` (``PATH`` or ``NAME=PATH``), with ``extra_args`` added to its
    command line; the caller stops it (by PID)."""
    # A GPU per rank: the server's default, one rank per GPU (NCCL). Fewer: CPU ranks (gloo).
    from deepspeed_tinker.launch import ServerProcess, cuda_device_count

    device = "auto" if cuda_device_count() >= world_size else "cpu"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    keys_file = tmp_dir / "api-keys"
    keys_file.write_text(f"# the tests' key\n{API_KEY}\n")
    extra = ["--max-chunk-datums", "4", "--long-poll-s", "1", "--device", device, "--api-keys-file", str(keys_file)]
    for path in base_models:
        extra += ["--base-model", str(path)]
    extra += list(extra_args)
    server = ServerProcess(world_size=world_size, zero_stage=zero_stage,
                           checkpoint_dir=checkpoint_dir or tmp_dir / "ckpt", extra_args=extra,
                           log_path=tmp_dir / f"server-zero{zero_stage}.log")
    try:
        server.start(timeout_s=START_TIMEOUT_S)
    except Exception as e:
        raise RuntimeError(f"{e}\n--- {server.log_path} ---\n{log_tail(server)}") from None
    return server


def run_rank_script(script: Path, args: list[str], out_dir: Path, world_size: int = 2,
                    timeout_s: float = 300.0) -> list[dict]:
    """Run ``script OUT_DIR ARGS...`` on ``world_size`` gloo CPU ranks (``local_ranks.ranks.start_ranks``, each rank's
    output in ``out_dir/rank<r>.log``) and return what each rank wrote to ``out_dir/rank<r>.json``. A rank that exits
    non-zero (negative: the signal that killed it) fails the test with the ranks' logs."""
    from local_ranks.procs import kill_tree
    from local_ranks.ranks import start_ranks

    procs = start_ranks([sys.executable, str(script), str(out_dir), *args], world_size, cpu=True,
                        env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=Path(__file__).resolve().parents[2],
                        log_dir=out_dir)
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
    logs = "\n".join((out_dir / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(world_size))
    assert codes == [0] * world_size, f"ranks exited {codes}\n{logs}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def log_tail(server, lines: int = 40) -> str:
    try:
        return "\n".join(server.log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def served(tmp_dir: Path, zero_stage: int, **start: Any) -> Iterator:
    """``start_server``'s server for the ``with`` block (a module fixture's body), stopped by ``stop_server``."""
    server = start_server(tmp_dir, zero_stage, **start)
    try:
        yield server
    finally:
        stop_server(server)


def stop_server(server) -> None:
    """Stop by PID; a server that does not exit 0 fails the test, with its log."""
    code = server.stop(timeout_s=STOP_TIMEOUT_S)
    assert code == 0, f"server did not stop cleanly (exit {code})\n--- {server.log_path} ---\n{log_tail(server)}"


def post(base_url: str, route: str, body: bytes | dict, **headers: str) -> dict[str, Any]:
    """POST to the server directly, as a client other than the SDK would (or a retrying one)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    content_type = "application/x-protobuf" if isinstance(body, bytes) else "application/json"
    request = urllib.request.Request(f"{base_url}/api/v1/{route}", data=data, method="POST",
                                     headers={"X-API-Key": API_KEY, "Content-Type": content_type, **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        return {"http_status": e.code, **json.loads(e.read() or b"{}")}


def poll_once(base_url: str, request_id: str) -> dict[str, Any]:
    return post(base_url, "retrieve_future", {"request_id": request_id})


def result(base_url: str, request_id: str, timeout_s: float = RESULT_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = poll_once(base_url, request_id)
        if reply.get("type") != "try_again":
            return reply
        assert time.monotonic() < deadline, f"{request_id} still pending after {timeout_s} s"


def random_data(rng: np.random.Generator, n: int, vocab: int = 256) -> list[tuple[list[int], list[int], list[float]]]:
    """(tokens, targets, weights) with varied lengths; some weights 0, some above 1."""
    data = []
    for _ in range(n):
        length = int(rng.integers(3, 14))
        data.append((rng.integers(0, vocab, length).tolist(), rng.integers(0, vocab, length).tolist(),
                     rng.choice([0.0, 0.5, 1.0, 2.0], length).astype(float).tolist()))
    return data


def to_sdk(data: list[tuple[list[int], list[int], list[float]]]) -> list:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
            for tokens, targets, weights in data]


def fwdbwd_proto(model_id: str, seq_id: int, data: list, *, loss_fn: str = "cross_entropy",
                 forward_only: bool = False) -> bytes:
    """A ForwardBackwardRequest body exactly as the SDK would encode it."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=to_sdk(data), loss_fn=loss_fn),
        model_id=model_id, seq_id=seq_id)
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def build_tiny_hf_model(directory: Path) -> Path:
    """A tiny GPT-2 (not a Llama: any ``AutoModelForCausalLM`` architecture is servable) saved with
    ``save_pretrained``, with the byte-level tokenizer beside it. Nothing is downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from deepspeed_tinker.byte_tokenizer import write_byte_tokenizer

    if not (directory / "config.json").is_file():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=96, n_embd=32, n_layer=2, n_head=2,
                                               bos_token_id=None, eos_token_id=None))
        model.save_pretrained(str(directory))
        write_byte_tokenizer(directory)
    return directory.resolve()


def reference_elementwise_loss(loss_fn: str, logprobs: torch.Tensor, datum: dict[str, Any],
                               config: dict[str, float] | None = None) -> torch.Tensor:
    """Tinker's loss formulas, written out plainly on one unpadded datum (independently of the server's
    ``losses`` module): the server's ``loss:sum`` and gradients must match these."""
    config = config or {}
    if loss_fn == "cross_entropy":
        return -logprobs * torch.tensor(datum["weights"], dtype=torch.float32)
    sampling = torch.tensor(datum["logprobs"], dtype=torch.float32)
    advantages = torch.tensor(datum["advantages"], dtype=torch.float32)
    ratio = torch.exp(logprobs - sampling)
    if loss_fn == "importance_sampling":
        return -(ratio * advantages)
    if loss_fn == "ppo":
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    if loss_fn == "cispo":
        low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
        return -(torch.clamp(ratio, low, high).detach() * advantages * logprobs)
    if loss_fn == "dro":  # Tinker's docs: target_logprobs * advantages - 0.5 * beta * (target - sampling) ** 2
        return -(logprobs * advantages - 0.5 * config["beta"] * (logprobs - sampling)**2)
    if loss_fn == "gspo":  # Tinker's docs (GSPO-token): the masked mean log-ratio, each token's own gradient
        in_ratio = torch.tensor(datum["sequence_ratio_mask"]) != 0
        log_ratio = (logprobs.detach() - sampling)[in_ratio].mean()
        ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
        clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.min(ratio * advantages, clipped * advantages)
    if loss_fn == "stable_reinforce":  # this server's choice (Tinker publishes none): truncated-IS REINFORCE
        weight = torch.clamp(ratio, max=config.get("clip_high_threshold", 2.0)).detach()
        return -(weight * advantages * logprobs) * torch.tensor(datum["weights"], dtype=torch.float32)
    raise ValueError(loss_fn)


def adam(**overrides: float) -> dict[str, float]:
    params = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
              "grad_clip_norm": 0.0}
    params.update(overrides)
    return params


class PlainReplay:
    """Single-process plain PyTorch: the same sums and AdamW steps the server should have applied."""

    def __init__(self, base_model: str, lora: LoraSpec | None) -> None:
        self.model = build_model(base_model, lora)
        self.initial = {k: v.detach().clone() for k, v in self.state_dict().items()}
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3)
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, data: list, backward: bool = True) -> tuple[list[np.ndarray], float]:
        """Per-datum logprobs and the call's loss sum; the gradient of that sum is accumulated."""
        logprobs, total = [], 0.0
        for tokens, targets, weights in data:
            with torch.set_grad_enabled(backward):
                lp = token_logprobs(self.model, torch.tensor([tokens]), torch.tensor([targets]))[0]
                loss = cross_entropy_sum(lp, torch.tensor(weights, dtype=torch.float32))
            if backward:
                loss.backward()
            logprobs.append(lp.detach().numpy())
            total += float(loss.detach())
        return logprobs, total

    def logprobs(self, tokens: list[int], targets: list[int]) -> np.ndarray:
        with torch.no_grad():
            return token_logprobs(self.model, torch.tensor([tokens]), torch.tensor([targets]))[0].numpy()

    def loss_backward(self, data: list[dict[str, Any]], loss: Any) -> tuple[list[np.ndarray], float]:
        """Like ``forward_backward`` for datums given as dicts and ``loss(datum, logprobs) -> elementwise``."""
        logprobs, total = [], 0.0
        for datum in data:
            lp = token_logprobs(self.model, torch.tensor([datum["tokens"]]), torch.tensor([datum["targets"]]))[0]
            value = loss(datum, lp).sum()
            value.backward()
            logprobs.append(lp.detach().numpy())
            total += float(value.detach())
        return logprobs, total

    def optim_step(self, params: dict[str, float]) -> None:
        for group in self.optimizer.param_groups:
            group.update(lr=params["learning_rate"], betas=(params["beta1"], params["beta2"]), eps=params["eps"],
                         weight_decay=params["weight_decay"])
        if params["grad_clip_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(self.params, params["grad_clip_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights (what a checkpoint holds: the adapters for LoRA, everything otherwise)."""
        return {k: v.detach() for k, v in self.model.named_parameters() if v.requires_grad}


def saved_weights(checkpoint_root: Path, tinker_path: str) -> dict[str, torch.Tensor]:
    """The trainable weights a ``save_weights`` wrote as safetensors next to its DeepSpeed checkpoint, under the
    training module's parameter names."""
    model_id, name = parse_tinker_path(tinker_path)
    return read_weights(checkpoint_dir(checkpoint_root, model_id, name))


def max_weight_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert sorted(actual) == sorted(expected), "the saved model has other parameters than the replay"
    return max(float((actual[k].float() - expected[k].float()).abs().max()) for k in expected)


def assert_forward_backward_like_replay(future, replay: PlainReplay, batch: list, logprob_atol: float) -> None:
    """A ``forward_backward``'s answer (its loss and each datum's logprobs) equals the replay's forward-backward of
    ``batch``, which also accumulates the replay's gradient. Within tolerances: the replay sums datum by datum, the
    server over a padded batch."""
    output = future.result(timeout=RESULT_TIMEOUT_S)
    expected_logprobs, expected_loss = replay.forward_backward(batch)
    assert output.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-4)
    for got, want in zip(output.loss_fn_outputs, expected_logprobs, strict=True):
        np.testing.assert_allclose(got["logprobs"].data, want, atol=logprob_atol)


def assert_trained_like_replay(training, server, replay: PlainReplay, name: str, atol: float) -> None:
    """The server's saved weights equal the plain-PyTorch replay's, and training moved them well beyond
    ``atol`` (otherwise the comparison says nothing)."""
    saved = training.save_state(name).result(timeout=RESULT_TIMEOUT_S)
    difference = max_weight_difference(saved_weights(server.checkpoint_dir, saved.path), replay.state_dict())
    assert difference < atol, f"weights differ from the replay by {difference}"
    moved = max_weight_difference(replay.initial, replay.state_dict())
    assert moved > 100 * atol, f"training barely moved the weights ({moved}): the comparison says nothing"

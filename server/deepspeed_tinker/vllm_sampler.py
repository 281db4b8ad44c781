"""vLLM as the sampler (``serve --sampler vllm``): rollouts go to a vLLM server beside the ranks, not into their queue.

vLLM runs in its own process and its own Python environment (its pins conflict with the server's), started by rank 0
(``--vllm-python``) or already running (``--vllm-url``); it serves the base model through its OpenAI-compatible
API. A LoRA sampler snapshot is a PEFT adapter directory on disk, registered with vLLM (``/v1/load_lora_adapter``)
under a name derived from that directory the first time it is sampled, so an older sampling client keeps its
weights; at most ``max_adapters`` stay registered (least recently used first out), and one sampled again after it
left is registered again from its files. Full fine-tuning snapshots are refused: vLLM serves one set of base
weights.

Each sample of a request is its own vLLM request with its own seed (sample ``i`` depends on seed ``i`` only, as on
the ranks' sampler); vLLM batches them with everything else in flight. Logprobs are vLLM's own (``raw_logprobs``:
the model's, before temperature and top-k/top-p), which differ from the trainer's forward by kernel rounding
(docs/tinker-server/sampling.md measures the gap).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from .errors import UserError
from .jobs import JobKind
from .sampling import SampledSequence, SampleJob, SampleResult, SnapshotRef
from .scheduler import FutureStore

log = logging.getLogger("tinker_server")

#: Where ``serve --sampler vllm`` finds vLLM's Python when ``--vllm-python`` is not given.
VLLM_PYTHON_ENV = "DEEPSPEED_TINKER_VLLM_PYTHON"
#: LoRA adapters registered with vLLM at once (``--vllm-adapters``).
DEFAULT_ADAPTERS = 8
#: The largest LoRA rank vLLM is started for (``--vllm-max-lora-rank``); a model of a higher rank is refused at
#: ``create_model``.
DEFAULT_MAX_LORA_RANK = 64
#: A top-k slot with no token (the first prompt position): the SDK's "nothing here", as the ranks' sampler writes it.
NO_LOGPROB = -99999.0
#: vLLM requests (one per sample) in flight at once (this bounds the server's open connections), and one session's
#: share of them: the rest of a session's samples wait here, so one client's flood leaves room for the others.
MAX_IN_FLIGHT = 256
MAX_IN_FLIGHT_PER_SESSION = 64


FULL_WEIGHTS_REFUSED = ("full fine-tuning weights cannot be sampled with --sampler vllm (vLLM serves the base weights "
                        "and LoRA adapters): train with a lora_config, or serve with --sampler native")
#: Unnamed snapshots' adapters, under a model's folder of the checkpoint root (not checkpoints: never listed).
SNAPSHOTS_FOLDER = "sampler_snapshots"


class VllmUnavailable(RuntimeError):
    """vLLM could not be started or reached."""


@dataclass(frozen=True)
class VllmOptions:
    """How the server gets its vLLM: a Python to start one with, or the URL of one already serving ``model``."""

    python: str | None = None
    url: str | None = None
    adapters: int = DEFAULT_ADAPTERS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    #: vLLM's CPU KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``; ignored on GPUs).
    kv_cache_gib: int = 1
    #: torch threads for vLLM's CPU worker (``OMP_NUM_THREADS``).
    threads: int = 1
    #: Unnamed snapshots kept on disk per model (``--sampler-snapshots``).
    snapshots: int = 8
    #: The weights' dtype in vLLM (the server's ``--dtype``), and whether vLLM runs on the GPU beside the ranks: then
    #: it takes ``gpu_memory_fraction`` of the GPU's memory (the rest is training's) and captures CUDA graphs.
    dtype: str = "float32"
    gpu: bool = False
    gpu_memory_fraction: float = 0.3
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0


#: The most top-k logprobs per position a request may ask of vLLM (the hosted service's limit): each is a JSON entry
#: per position and sample in vLLM's answer.
MAX_TOPK = 20


def adapter_name(directory: str) -> str:
    """The vLLM model name of the adapter now in ``directory``: its path and its weights file's version, so a
    checkpoint saved again under the same name (``overwrite``) is registered as the new weights it is."""
    weights = Path(directory) / "adapter_model.safetensors"
    version = weights.stat().st_mtime_ns if weights.exists() else 0
    return "lora-" + hashlib.sha256(f"{Path(directory).resolve()}@{version}".encode()).hexdigest()[:16]


class VllmProcess:
    """``vllm serve`` in its own environment, for one base model directory, on a free loopback port."""

    def __init__(self, options: VllmOptions, model_dir: str, served_name: str, max_model_len: int,
                 log_file: Path) -> None:
        if not options.python:
            raise VllmUnavailable(f"--sampler vllm needs vLLM's Python: --vllm-python PATH or ${VLLM_PYTHON_ENV} "
                                  "(tools/vllm-env.sh builds one), or --vllm-url of a running vLLM")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.served_name = served_name
        command = [options.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                   "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port),
                   "--enable-lora", "--max-lora-rank", str(options.max_lora_rank), "--max-loras",
                   str(options.adapters), "--max-cpu-loras", str(options.adapters), "--max-logprobs", "-1",
                   "--max-model-len", str(max_model_len), "--dtype", options.dtype,
                   "--disable-log-stats", "--uvicorn-log-level", "warning"]
        if options.gpu:
            command += ["--gpu-memory-utilization", str(options.gpu_memory_fraction)]
        else:  # on CPUs torch.compile and CUDA graphs buy nothing
            command += ["--enforce-eager"]
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_CPU_KVCACHE_SPACE=str(options.kv_cache_gib), OMP_NUM_THREADS=str(options.threads),
                   VLLM_CPU_OMP_THREADS_BIND="nobind")
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # the server's environment must not leak into vLLM's
            env.pop(name, None)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file
        self._log = open(log_file, "ab")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        preexec_fn=_exit_with_parent)
        self.timeout_s = options.startup_timeout_s

    def wait_ready(self) -> str:
        """The URL once vLLM answers ``/health``; VllmUnavailable (with its log's tail) if it exits or times out."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise VllmUnavailable(f"vLLM exited with {self.process.returncode} while starting:\n{self._tail()}")
            try:
                healthy = httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy:
                self._warm_up()
                return self.url
            time.sleep(0.5)
        self.stop()
        raise VllmUnavailable(f"vLLM did not answer /health within {self.timeout_s:g} s:\n{self._tail()}")

    def _warm_up(self) -> None:
        """One token, so a model vLLM cannot run (e.g. a head size its CPU attention lacks) fails the start, not the
        first client's sample."""
        try:
            response = httpx.post(self.url + "/v1/completions", timeout=self.timeout_s,
                                  json={"model": self.served_name, "prompt": [0], "max_tokens": 1})
        except httpx.HTTPError as e:
            self.stop()
            raise VllmUnavailable(f"vLLM did not answer a first sample: {e}\n{self._tail()}") from None
        if response.status_code != 200:
            self.stop()
            raise VllmUnavailable(f"vLLM cannot sample {self.served_name}: {response.text[:300]}\n{self._tail()}")

    def _tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def exited(self) -> str | None:
        """Why vLLM is gone (its exit code and log), or None while it runs."""
        if self.process.poll() is None:
            return None
        return f"vLLM exited with code {self.process.returncode} (its log: {self.log_file})"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()


def _exit_with_parent() -> None:
    """In the child before exec: SIGTERM when the server's rank 0 exits, however it exits (Linux)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VllmSampler:
    """Rank 0's client of vLLM: ``submit`` creates the request's future and returns at once; a thread of its own
    runs the requests on an event loop and resolves the futures."""

    def __init__(self, url: str, served_name: str, futures: FutureStore, options: VllmOptions,
                 process: VllmProcess | None = None) -> None:
        self.url = url.rstrip("/")
        #: The vLLM this server started (None: ``--vllm-url``'s); ``/healthz`` reports it once it exited.
        self.process = process
        self.served_name = served_name
        self.futures = futures
        self.options = options
        self._adapters: collections.OrderedDict[str, None] = collections.OrderedDict()  # registered, LRU first
        self._in_use: collections.Counter[str] = collections.Counter()  # adapter -> requests sampling it now
        self._slots: dict[str, asyncio.Semaphore] = {}  # session -> its samples' share of MAX_IN_FLIGHT
        self._waiting: collections.Counter[str] = collections.Counter()  # session -> its requests here
        #: session -> request id -> its run on the loop (submitted from the HTTP threads, ended on the loop's).
        self._tasks: dict[str, dict[str, concurrent.futures.Future]] = {}
        self._tasks_lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-sampler", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._make_client())
        self._adapter_lock = self._call(self._make_lock())

    async def _make_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=32)
        return httpx.AsyncClient(base_url=self.url, timeout=self.options.request_timeout_s, limits=limits)

    @staticmethod
    async def _make_lock() -> asyncio.Lock:
        return asyncio.Lock()

    def _call(self, coroutine: Any, timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def snapshot_dir(self, root: Path, model_id: str, snapshot_id: str) -> Path:
        """Where an unnamed snapshot's adapter goes; the model's older ones beyond the newest ``snapshots - 1`` are
        deleted now (a sampling client of one gets a clear error, as when the ranks' sampler evicted it)."""
        folder = snapshots_folder(root, model_id)
        saved = []
        for path in folder.iterdir() if folder.is_dir() else ():
            try:
                if not path.name.startswith("."):  # a save's staging directory is not a snapshot
                    saved.append((path.stat().st_mtime, path))
            except FileNotFoundError:
                continue
        for _, old in sorted(saved)[:max(0, len(saved) - max(1, self.options.snapshots - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        return folder / snapshot_id

    def submit(self, job: SampleJob, session: str, owner: str) -> str:
        """Queue a validated sample on vLLM; its request id (FutureStoreFull if the session or store is full)."""
        if max(job.topk_prompt_logprobs, job.topk_sample_logprobs) > MAX_TOPK:
            raise SampleRefused(f"topk_prompt_logprobs and topk_sample_logprobs must be at most {MAX_TOPK} with "
                                "--sampler vllm")
        future = self.futures.create(session)
        self.futures.describe(future.request_id, JobKind.SAMPLE, owner)
        request_id = future.request_id
        with self._tasks_lock:
            task = asyncio.run_coroutine_threadsafe(self._run(request_id, job, session), self._loop)
            self._tasks.setdefault(session, {})[request_id] = task
        task.add_done_callback(lambda _: self._forget_task(session, request_id))
        return request_id

    def _forget_task(self, session: str, request_id: str) -> None:
        with self._tasks_lock:
            tasks = self._tasks.get(session, {})
            tasks.pop(request_id, None)
            if not tasks:
                self._tasks.pop(session, None)

    def cancel_session(self, session: str, reason: str) -> int:
        """A closed session's samples: each one not finished fails with ``reason`` and is cancelled (vLLM aborts a
        request whose connection closes); how many."""
        with self._tasks_lock:
            tasks = self._tasks.pop(session, {})
        for request_id, task in tasks.items():
            self.futures.fail(request_id, reason, "user")
            task.cancel()
        return len(tasks)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ requests

    async def _run(self, request_id: str, job: SampleJob, session: str) -> None:
        model = None
        slots = self._slots.setdefault(session, asyncio.Semaphore(MAX_IN_FLIGHT_PER_SESSION))
        self._waiting[session] += 1
        try:
            model = await self._model_for(job.snapshot)
            async with asyncio.TaskGroup() as group:  # one sample failing cancels the others
                tasks = [group.create_task(self._complete(model, job, i, slots)) for i in range(job.num_samples)]
            self.futures.resolve(request_id, self._result(job, [task.result() for task in tasks]))
        except SampleRefused as e:
            self.futures.fail(request_id, str(e), "user")
        except asyncio.CancelledError:  # cancel_session failed it already; this covers any other cancellation
            self.futures.fail(request_id, "the sample was cancelled", "user")
            raise
        except Exception as e:  # vLLM down, or an answer we cannot read: the client sees a server error
            error = e.exceptions[0] if isinstance(e, ExceptionGroup) else e
            if self.process is not None and self.process.exited():
                error = VllmUnavailable(self.process.exited())
            log.error("vLLM sampling failed for %s: %s: %s", request_id, type(error).__name__, error)
            self.futures.fail(request_id, f"the vLLM sampler failed: {type(error).__name__}: {error}", "server")
        finally:
            if model is not None and model != self.served_name:
                self._in_use[model] -= 1
            self._waiting[session] -= 1
            if not self._waiting[session]:  # the session's last request here: its slots go
                del self._waiting[session], self._slots[session]

    async def _complete(self, model: str, job: SampleJob, index: int, slots: asyncio.Semaphore) -> dict[str, Any]:
        async with slots:
            return await self._complete_one(model, job, index)

    async def _complete_one(self, model: str, job: SampleJob, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "prompt": list(job.prompt), "max_tokens": job.max_tokens, "n": 1,
            "temperature": job.temperature, "top_p": job.top_p, "top_k": job.top_k, "seed": job.seeds[index] % 2**63,
            # The stop tokens are the model's EOS unless the client named its own (or none): vLLM's own EOS check
            # is off, so exactly these stop, and the token that stops is kept, as on the ranks' sampler.
            "ignore_eos": True, "stop_token_ids": list(job.stop_tokens), "stop": list(job.stop_strings),
            "include_stop_str_in_output": True, "logprobs": job.topk_sample_logprobs,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
        }
        if index == 0 and job.prompt_logprobs:
            body["prompt_logprobs"] = job.topk_prompt_logprobs
        response = await self._client.post("/v1/completions", json=body)
        if response.status_code == 404 and model != self.served_name:  # the adapter left vLLM: register it again
            await self._register(model, job.snapshot.file or "", force=True)
            response = await self._client.post("/v1/completions", json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"vLLM answered {response.status_code}: {response.text[:500]}")
        choice = response.json()["choices"][0]
        if choice.get("finish_reason") not in ("stop", "length"):  # e.g. "abort": vLLM gave up on it
            raise RuntimeError(f"vLLM ended a sample with finish_reason {choice.get('finish_reason')!r}")
        return choice

    def _result(self, job: SampleJob, choices: list[dict[str, Any]]) -> SampleResult:
        k = job.topk_sample_logprobs
        sequences = []
        for choice in choices:
            tokens = np.asarray(choice["token_ids"], np.int32)
            logprobs = choice.get("logprobs") or {}
            values = np.asarray([math.nan if v is None else v for v in logprobs.get("token_logprobs") or []],
                                np.float32)
            topk_ids = topk_values = None
            if k > 0:
                topk_ids, topk_values = _topk_rows(logprobs.get("top_logprobs") or [], k)
            reason = "length" if choice.get("finish_reason") == "length" else "stop"
            sequences.append(SampledSequence(tokens, values, reason, topk_ids, topk_values))
        prompt = topk_prompt_ids = topk_prompt_values = None
        if job.prompt_logprobs:
            prompt, topk_prompt_ids, topk_prompt_values = _prompt_logprobs(job, choices[0].get("prompt_logprobs"))
        return SampleResult(tuple(sequences), prompt, topk_prompt_ids, topk_prompt_values)

    # ------------------------------------------------------------------ adapters

    async def _model_for(self, snapshot: SnapshotRef) -> str:
        """The vLLM model name that serves ``snapshot``'s weights, registering its adapter if needed."""
        if snapshot.base_model != self.served_name:
            raise SampleRefused(f"base model {snapshot.base_model!r} cannot be sampled here: this server's vLLM "
                                f"sampler serves {self.served_name!r}")
        if snapshot.snapshot_id.startswith("base:"):
            return self.served_name
        if snapshot.lora is None:
            raise SampleRefused(FULL_WEIGHTS_REFUSED)
        if not snapshot.file or not (Path(snapshot.file) / "adapter_config.json").is_file():
            raise SampleRefused(f"no LoRA adapter files for the sampler weights {snapshot.snapshot_id} (an unnamed "
                                "snapshot older than its model's newest --sampler-snapshots is deleted); save them "
                                "again")
        name = adapter_name(snapshot.file)
        await self._register(name, snapshot.file)
        return name

    async def _register(self, name: str, directory: str, force: bool = False) -> None:
        """Register ``name`` (if it is not) and count this request as using it until ``_run`` ends. Beyond
        ``adapters`` registered, the least recently used adapter no request is sampling leaves vLLM (when every one is
        in use, none leaves: the requests in flight bound how far over it goes)."""
        async with self._adapter_lock:
            if name in self._adapters and not force:
                self._adapters.move_to_end(name)
                self._in_use[name] += 1
                return
            idle = [old for old in self._adapters if not self._in_use[old] and old != name]
            for old in idle[:max(0, len(self._adapters) + 1 - self.options.adapters)]:
                del self._adapters[old]
                self._in_use.pop(old, None)
                await self._unload(old)
            response = await self._load(name, directory)
            if response.status_code == 400:  # vLLM still has it (an unload that failed, or a vLLM we did not start)
                await self._unload(name)
                response = await self._load(name, directory)
            if response.status_code >= 400:
                raise RuntimeError(f"vLLM refused the adapter in {directory}: {response.text[:500]}")
            self._adapters[name] = None
            if not force:
                self._in_use[name] += 1

    async def _load(self, name: str, directory: str) -> httpx.Response:
        return await self._client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": directory})

    async def _unload(self, name: str) -> None:
        """Unload ``name`` from vLLM; a failure is logged (a later load of the name unloads it first)."""
        try:
            await self._client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        except httpx.HTTPError as e:
            log.warning("vLLM: unloading adapter %s failed: %s", name, e)


def snapshots_folder(root: Path, model_id: str) -> Path:
    """Where a model's unnamed snapshots' adapters are written (deleted with the model)."""
    return root / model_id.replace("/", "_") / SNAPSHOTS_FOLDER


class SampleRefused(UserError):
    """A sample this sampler cannot serve; the client's error (category ``user``)."""


def _token_id(key: str) -> int:
    """``token_id:<n>`` (vLLM's ``return_tokens_as_token_ids``) or a bare id."""
    return int(key.rsplit(":", 1)[-1])


def _topk_rows(rows: list[dict[str, float] | None], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most likely tokens per position, most likely first (vLLM adds the sampled token to its top k)."""
    ids = np.zeros((len(rows), k), np.int32)
    values = np.full((len(rows), k), NO_LOGPROB, np.float32)
    for i, row in enumerate(rows):
        best = sorted(((v, _token_id(t)) for t, v in (row or {}).items()), key=lambda p: -p[0])[:k]
        for j, (value, token) in enumerate(best):
            ids[i, j], values[i, j] = token, value
    return ids, values


def _prompt_logprobs(job: SampleJob, rows: list[dict[str, Any] | None] | None) -> tuple[Any, Any, Any]:
    """``[NaN, log p(prompt[1] | prompt[:1]), ...]`` (NaN before the last ``prompt_logprobs_last_n``), and the top k
    per position when asked."""
    rows = rows or []
    n = len(job.prompt)
    values = np.full(n, np.nan, np.float32)
    k = job.topk_prompt_logprobs
    ids = np.zeros((n, k), np.int32) if k else None
    topk = np.full((n, k), NO_LOGPROB, np.float32) if k else None
    for i in range(1, min(n, len(rows))):
        row = {_token_id(t): (v["logprob"] if isinstance(v, dict) else v) for t, v in (rows[i] or {}).items()}
        values[i] = row.get(job.prompt[i], math.nan)
        if k:
            best = sorted(row.items(), key=lambda p: -p[1])[:k]
            for j, (token, value) in enumerate(best):
                ids[i, j], topk[i, j] = token, value
    if job.prompt_logprobs_last_n is not None:
        values[:n - job.prompt_logprobs_last_n] = np.nan
    return values, ids, topk

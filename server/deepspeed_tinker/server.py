"""One rank of the server. Rank 0 serves HTTP and drives; every rank trains and samples.

Rank 0 takes jobs from the scheduler in order, broadcasts each to all ranks, runs its own share
and gathers the others' parts. The other ranks only follow that broadcast, so every rank sees the
same commands in the same order and DeepSpeed's collectives line up.

A rank reads only the standard launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so the same entry point runs under this package's own launcher, ``torchrun`` and
DeepSpeed's ``deepspeed`` launcher, on one node or several. With CUDA GPUs (and ``--device``
``auto`` or ``cuda``) each rank takes the GPU of its LOCAL_RANK and the ranks talk NCCL; otherwise
gloo on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import warnings
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from local_ranks.ranks import disable_cpu_shm_allreduce

from .api import ApiSettings, TinkerApi
from .byte_tokenizer import write_byte_tokenizer
from .commands import COMMANDS, Recorder, run_command
from .config import ServerConfig
from .errors import UserError
from .faults import EXIT_RANK_FAILED, HEARTBEAT_S, FaultDrain, PeerWatch, heartbeat
from .http_app import HttpServer, HttpSettings, build_app
from .jobs import JobKind
from .keys import check_host, load_api_keys, startup_line
from .metrics import start_memory_reporter
from .model import BASE_MODELS, parse_base_model, register_local_model
from .scheduler import FutureStore, Job, Scheduler
from .threads import intra_op_threads
from .vllm_sampler import VllmProcess, VllmSampler
from .worker import Worker

log = logging.getLogger("tinker_server")


def versions_line() -> str:
    """What this ran on: torch, DeepSpeed, and the patch series (the local version label)."""
    import deepspeed

    version = deepspeed.__version__
    series = version.split("+", 1)[1] if "+" in version else "none (pristine DeepSpeed)"
    return f"torch {torch.__version__} | deepspeed {version} | series {series}"


def _run_safely(worker: Worker, kind: JobKind, model_id: str, payload: Any) -> tuple[str, Any]:
    """This rank's part, or the error; never raises, so a failure cannot strand the other ranks."""
    try:
        return "ok", run_command(worker, kind, model_id, payload)
    except UserError as e:
        return "user", str(e)
    except Exception as e:
        log.exception("rank %d failed on %s for %s", worker.rank, kind, model_id)
        return "server", f"{type(e).__name__}: {e}"


def _on_every_rank(worker: Worker, command: tuple[JobKind, str, Any]) -> list[Any]:
    """Broadcast a command, run this rank's part, and gather every rank's (status, part); raises if a collective
    does (a rank died, or the group is otherwise broken)."""
    if worker.world_size == 1:  # nobody to tell or hear from: the collectives' round trips are a step's overhead
        return [_run_safely(worker, *command)]
    box: list[Any] = [command]
    dist.broadcast_object_list(box, src=0)
    parts: list[Any] = [None] * worker.world_size
    dist.gather_object(_run_safely(worker, *box[0]), parts, dst=0)
    return parts


def _collective_failed(jobs: list[Job], error: Exception, futures: FutureStore, drain: FaultDrain) -> None:
    """The ranks can no longer be trusted to run commands in step: fail the jobs, then every other request. A rank
    that died is the usual cause: the watch names it within moments (its message is the more useful one)."""
    deadline = time.monotonic() + 3 * HEARTBEAT_S
    while not drain.tripped and time.monotonic() < deadline:
        time.sleep(0.05)
    message = (f"a collective between the ranks failed while running {jobs[0].kind}: {type(error).__name__}: "
               f"{error}")
    log.error("rank 0: %s", message)
    for job in jobs:
        futures.fail(job.request_id, message, "server")
    drain.trip(message)


def _execute(worker: Worker, job: Job, futures: FutureStore, drain: FaultDrain, recorder: Recorder) -> bool:
    """Run a job on every rank; whether every rank succeeded. What its command records is recorded before the future
    resolves (a checkpoint is in the store before its save is acknowledged)."""
    command = COMMANDS[job.kind]
    try:
        parts = _on_every_rank(worker, (job.kind, job.model_id, job.payload))
    except Exception as e:
        _collective_failed([job], e, futures, drain)
        return False
    failures = [part for part in parts if part[0] != "ok"]
    if failures:
        futures.fail(job.request_id, failures[0][1], failures[0][0])
        return False
    return _record_and_resolve(job, command.merge([part[1] for part in parts]), futures, recorder)


def _record_and_resolve(job: Job, result: Any, futures: FutureStore, recorder: Recorder) -> bool:
    record = COMMANDS[job.kind].record
    try:
        if record is not None:
            record(recorder, job.payload)
    except Exception as e:
        log.exception("rank 0: recording %s for %s", job.kind, job.model_id)
        futures.fail(job.request_id, f"the server could not record the result: {type(e).__name__}: {e}", "server")
        return False
    futures.resolve(job.request_id, result)
    return True


def _execute_batch(worker: Worker, jobs: list[Job], futures: FutureStore, drain: FaultDrain,
                   recorder: Recorder) -> list[bool]:
    """Consecutive jobs of a kind that batches (concurrent sampling requests) as one command of its ``batch_kind`` on
    every rank, so they run as one batch (``SamplerPool.sample_many``); each future gets its own result or its own
    user error."""
    batch_kind = COMMANDS[jobs[0].kind].batch_kind
    try:
        parts = _on_every_rank(worker, (batch_kind, "", tuple(job.payload for job in jobs)))
    except Exception as e:
        _collective_failed(jobs, e, futures, drain)
        return [False] * len(jobs)
    failures = [part for part in parts if part[0] != "ok"]
    if failures:
        for job in jobs:
            futures.fail(job.request_id, failures[0][1], failures[0][0])
        return [False] * len(jobs)
    done = []
    for job, (status, value) in zip(jobs, COMMANDS[batch_kind].merge([part[1] for part in parts])):
        if status == "ok":
            done.append(_record_and_resolve(job, value, futures, recorder))
        else:
            futures.fail(job.request_id, value, status)
            done.append(False)
    return done


def _start_vllm(config: ServerConfig, futures: FutureStore,
                gpu: bool) -> tuple[VllmProcess | None, VllmSampler | None]:
    """With ``--sampler vllm``: vLLM serving the one ``--base-model`` (started here unless ``--vllm-url``), and rank
    0's client of it."""
    if config.sampler != "vllm":
        return None, None
    name, path = parse_base_model(config.base_models[0])
    spec = BASE_MODELS[name or str(Path(path).expanduser().resolve())]
    options = replace(config.vllm_options(), snapshots=config.sampler_snapshots, gpu=gpu,
                      dtype="bfloat16" if config.dtype == "bf16" else "float32")
    process = None
    url = config.vllm_url
    if url is None:
        process = VllmProcess(options, str(spec.path), spec.name, spec.max_context_length,
                              config.checkpoint_root / "vllm.log")
        print(f"[tinker-server] starting vLLM for {spec.name} (log: {process.log_file})", flush=True)
        url = process.wait_ready()
    return process, VllmSampler(url, spec.name, futures, options, process)


def _drive(worker: Worker, config: ServerConfig, watch: PeerWatch | None) -> None:
    """Rank 0: serve HTTP, execute jobs in order until SIGTERM/SIGINT, then stop the followers.

    After a fault (``watch`` finds a rank dead, or a collective raises) it never returns: the drain fails every
    request for ``fault_drain_s`` and exits the process (``faults.FaultDrain``)."""
    futures = FutureStore(config.max_futures, config.future_ttl_s, config.max_futures_per_session,
                          config.retrieved_grace_s)
    scheduler = Scheduler(futures)
    tokenizer_dir = write_byte_tokenizer(config.checkpoint_root / "tokenizers" / "byte-level")
    vllm_process, vllm = _start_vllm(config, futures, worker.device.type == "cuda")
    api = TinkerApi(scheduler, ApiSettings(config.checkpoint_root, config.max_chunk_datums, config.compress_fwdbwd,
                                           config.long_poll_s, tokenizer_dir.resolve(),
                                           keep_checkpoints=config.keep_checkpoints,
                                           session_timeout_s=config.session_timeout_s), vllm)
    keys = load_api_keys(config.api_keys_file)
    check_host(config.host, keys)
    http_settings = HttpSettings(max_body_bytes=config.max_body_bytes, access_log=config.access_log, api_keys=keys)
    http = HttpServer(build_app(api, http_settings), config.host, config.port, http_settings).start()

    def stop_vllm() -> None:
        if vllm is not None:
            vllm.close()
        if vllm_process is not None:
            vllm_process.stop()

    def after_fault() -> None:
        http.shutdown()
        api.store.close()
        stop_vllm()

    drain = FaultDrain(futures.fail_all, scheduler.stop, config.fault_drain_s, after_fault)
    if watch is not None:
        watch.start(drain.trip)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: scheduler.stop())
    host = "127.0.0.1" if config.host in ("", "0.0.0.0") else config.host
    base_url = f"http://{host}:{http.port}"
    print(f"[tinker-server] {versions_line()}", flush=True)
    print(f"[tinker-server] {worker.world_size} ranks on {worker.device.type}, ZeRO stage {worker.zero_stage}, "
          f"{worker.dtype}{', gradient checkpointing' if worker.gradient_checkpointing else ''}, "
          f"serving {base_url} (pid {os.getpid()})", flush=True)
    print(f"[tinker-server] {startup_line(config.host, keys)}", flush=True)
    print(f"[tinker-server] if a rank dies (or is silent {config.peer_timeout_s:g} s) or a collective fails: every "
          f"request fails with a server error for {config.fault_drain_s:g} s, then exit code {EXIT_RANK_FAILED}",
          flush=True)
    if config.ready_file is not None:
        tmp = config.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"base_url": base_url, "pid": os.getpid()}))
        tmp.replace(config.ready_file)
    try:
        api.reap_expired(every_s=0)  # what expired while the server was down
        api.prune_checkpoints()  # a run's older checkpoints, should --keep-checkpoints be lower than before
        while not scheduler.stopped:
            api.reap_expired()  # here, between jobs, a save never has its directory deleted under it
            job = scheduler.next_job(timeout=1.0)
            if job is None or drain.tripped:
                continue
            command = COMMANDS[job.kind]
            if command.prepare is not None:
                try:
                    command.prepare(worker, api, job.model_id, job.payload)
                except UserError as e:
                    futures.fail(job.request_id, str(e), "user")
                    continue
            if command.batch_kind is not None:
                batch = [job, *scheduler.take_consecutive(job.kind, command.batch_limit - 1)]
                if len(batch) > 1:
                    _execute_batch(worker, batch, futures, drain, api)
                    continue
            _execute(worker, job, futures, drain, api)
    finally:
        if drain.tripped:
            drain.wait()  # no collective with a broken group: the drain thread exits the process
        if watch is not None:
            watch.disarm()  # the followers exit now, which is no fault
        dist.broadcast_object_list([None], src=0)
        http.shutdown()
        api.store.close()
        stop_vllm()
        print("[tinker-server] stopped", flush=True)


def _follow(worker: Worker) -> None:
    """Ranks > 0: run whatever rank 0 broadcasts until it broadcasts None."""
    # A terminal's Ctrl-C, or a launcher's SIGTERM to every rank (torchrun, deepspeed), reaches rank 0 too,
    # which finishes its job and then stops us: dying here would strand rank 0 in a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        command: list[Any] = [None]
        dist.broadcast_object_list(command, src=0)
        if command[0] is None:
            return
        dist.gather_object(_run_safely(worker, *command[0]), None, dst=0)


def backend_and_device(choice: str) -> tuple[str, torch.device]:
    """NCCL and this rank's GPU (LOCAL_RANK) when CUDA is there and wanted, else gloo on the CPU.

    Must run before DeepSpeed is imported: on the CPU it selects DeepSpeed's CPU accelerator, whose
    device count comes from LOCAL_SIZE (torchrun and the deepspeed launcher set LOCAL_WORLD_SIZE).
    """
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available() and torch.cuda.device_count() > 0):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return "gloo", torch.device("cpu")


def _watch_ranks(timeout_s: float) -> PeerWatch | None:
    """Rank 0: a ``PeerWatch`` every other rank has connected to (None alone); the others: start heartbeating."""
    if dist.get_world_size() == 1:
        return None
    watch = PeerWatch(dist.get_world_size(), timeout_s) if dist.get_rank() == 0 else None
    address: list[Any] = [(watch.port, watch.token) if watch is not None else None]
    dist.broadcast_object_list(address, src=0)
    if watch is not None:
        watch.accept()
        return watch
    port, token = address[0]
    heartbeat(os.environ.get("MASTER_ADDR", "127.0.0.1"), port, token, dist.get_rank())
    return None


def run_rank(config: ServerConfig) -> int:
    """Entry point of one rank process; the launcher sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* ."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)  # libraries' deprecation notices, not ours
    backend, device = backend_and_device(config.device)
    threads, why = intra_op_threads(config.threads_per_rank)
    torch.set_num_threads(threads)
    print(f"[tinker-server] rank {os.environ.get('RANK', '0')}: {threads} intra-op thread(s) ({why})", flush=True)
    for path in config.base_models:
        register_local_model(path)
    # Ranks > 0 wait in a broadcast while the server is idle: give that wait a day, not 30 minutes.
    dist.init_process_group(backend, timeout=timedelta(days=1))
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    disable_cpu_shm_allreduce()
    deepspeed.init_distributed(dist_backend=backend)
    watch = _watch_ranks(config.peer_timeout_s)
    rank, world, limits = dist.get_rank(), dist.get_world_size(), (config.sampler_snapshots,
                                                                   config.sampler_snapshot_bytes)
    worker = Worker(rank, world, config.zero_stage, device, dtype=config.dtype, snapshots=limits,
                    gradient_checkpointing=config.gradient_checkpointing)
    start_memory_reporter(worker)  # for rank 0's /metrics
    try:
        if worker.rank == 0:
            _drive(worker, config, watch)
        else:
            _follow(worker)
    finally:
        try:
            dist.destroy_process_group()
        except Exception as e:  # a peer that already exited is no reason to fail a clean stop
            log.warning("rank %d: destroy_process_group: %s", worker.rank, e)
    return 0

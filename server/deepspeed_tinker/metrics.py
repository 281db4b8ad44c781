"""What an operator scrapes (``GET /metrics``, Prometheus text format) and the log line per training step.

Rank 0 knows the requests (``FutureStore.on_finish`` calls ``ServerMetrics.observe``) and the queues (the
scheduler); each rank's memory comes from that rank: a thread on every rank (``start_memory_reporter``) writes it to
the process group's key-value store every few seconds, where rank 0 reads it at scrape time (no collective, so a
scrape never waits for a job). Metrics live in the server's own registry, not the library's global one.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import psutil
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .commands import COMMANDS, TOKEN_LABELS, StepRole
from .sampling import SampleResult
from .scheduler import Future, Scheduler
from .wire import FwdBwdResult

#: One INFO line per optim_step (``tinker_server.steps``), whatever the server's log level.
STEP_LOG = logging.getLogger("tinker_server.steps")
log = logging.getLogger("tinker_server")

#: Where each rank's memory is written in the process group's store.
MEMORY_KEY = "deepspeed_tinker/rank_memory/{rank}"
#: How often each rank writes it.
MEMORY_EVERY_S = 2.0
#: The figures of a rank's memory report that /metrics shows (the report also has when it was made, ``time``, and
#: when the engines' tensors were last counted, ``counted_at``).
MEMORY_KINDS = ("rss", "engines", "snapshots", "device_allocated")
#: ``tinker_tokens_per_second`` is over the jobs finished in this window.
TOKENS_WINDOW_S = 60.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def result_tokens(result: Any) -> int:
    """Tokens a finished request processed: every datum's tokens for (forward_)backward, the generated tokens of
    every sample for sampling."""
    if isinstance(result, FwdBwdResult):
        return sum(int(values.shape[0]) for values in result.logprobs)
    if isinstance(result, SampleResult):
        return sum(len(sequence.tokens) for sequence in result.sequences)
    return 0


@dataclass
class _Step:
    """A model's forward_backward work since its last optim_step."""

    requests: int = 0
    tokens: int = 0
    first_started: float | None = None


class ServerMetrics:
    """The server's metrics registry; ``observe`` each finished future, ``render`` at scrape time."""

    def __init__(self, scheduler: Scheduler, open_sessions: Callable[[], int] = lambda: 0,
                 rank_memory: Callable[[], dict[int, dict[str, float]]] | None = None) -> None:
        self.scheduler = scheduler
        self.open_sessions = open_sessions
        self.rank_memory = rank_memory or read_rank_memory
        self.registry = CollectorRegistry()
        self.latency = Histogram("tinker_request_latency_seconds",
                                 "From a request's acceptance to its result (queueing included), by job kind",
                                 ["kind"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.run_time = Histogram("tinker_request_run_seconds",
                                  "From a request's job start on the ranks to its result (a batch of samples: the "
                                  "batch's time), by job kind", ["kind"], buckets=LATENCY_BUCKETS,
                                  registry=self.registry)
        self.requests = Counter("tinker_requests", "Requests finished, by job kind and outcome (ok, user, server)",
                                ["kind", "status"], registry=self.registry)
        self.tokens = Counter("tinker_tokens", "Tokens processed: train (forward_backward datums), forward "
                              "(forward-only datums), sample (generated tokens)", ["kind"], registry=self.registry)
        self.registry.register(_LiveCollector(self))
        self._lock = threading.Lock()
        self._window: collections.deque[tuple[float, str, int]] = collections.deque()
        self._steps: dict[str, _Step] = {}
        if STEP_LOG.level == logging.NOTSET:
            STEP_LOG.setLevel(logging.INFO)

    def observe(self, future: Future) -> None:
        """Record a finished request (``FutureStore.on_finish``)."""
        kind = str(future.kind or "unknown")
        command = COMMANDS.get(future.kind) if future.kind is not None else None
        status = "ok" if future.status == "ok" else (future.category or "server")
        self.requests.labels(kind, status).inc()
        if future.finished is None:
            return
        self.latency.labels(kind).observe(future.finished - future.created)
        if future.started is not None:
            self.run_time.labels(kind).observe(future.finished - future.started)
        if future.status != "ok":
            return
        if command is None:
            return
        tokens = result_tokens(future.result)
        if command.tokens is not None and tokens:
            self.tokens.labels(command.tokens).inc(tokens)
            with self._lock:
                self._window.append((future.finished, command.tokens, tokens))
        if command.step is StepRole.ACCUMULATE:
            with self._lock:
                step = self._steps.setdefault(future.model_id, _Step())
                step.requests += 1
                step.tokens += tokens
                if step.first_started is None:
                    step.first_started = future.started if future.started is not None else future.created
        elif command.step is StepRole.END:
            self._log_step(future)
        elif command.step is StepRole.FORGET:
            with self._lock:
                self._steps.pop(future.model_id, None)

    def _log_step(self, future: Future) -> None:
        with self._lock:
            step = self._steps.pop(future.model_id, _Step())
        metrics = (future.result or {}).get("metrics", {}) if isinstance(future.result, dict) else {}
        elapsed = future.finished - (step.first_started if step.first_started is not None else future.created)
        rate = step.tokens / elapsed if elapsed > 0 else 0.0
        STEP_LOG.info("step %d of %s (session %s): %d forward_backward request(s), %d datums, %d tokens in %.3f s "
                      "(%.0f tokens/s); optim_step waited %.1f ms, ran %.1f ms",
                      int(metrics.get("optim_steps:max", 0)), future.model_id, future.session or "-", step.requests,
                      int(metrics.get("datums:sum", 0)), step.tokens, elapsed, rate,
                      1000 * ((future.started or future.finished) - future.created),
                      1000 * (future.finished - (future.started or future.finished)))

    def tokens_per_second(self, now: float | None = None) -> dict[str, float]:
        """Tokens per second of each kind over the jobs finished in the last ``TOKENS_WINDOW_S``."""
        now = time.monotonic() if now is None else now
        totals = {label: 0 for label in TOKEN_LABELS}
        with self._lock:
            while self._window and self._window[0][0] < now - TOKENS_WINDOW_S:
                self._window.popleft()
            for _, label, tokens in self._window:
                totals[label] += tokens
        return {label: total / TOKENS_WINDOW_S for label, total in totals.items()}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    """Gauges read at scrape time: queue depth per session, futures, sessions, tokens/s, per-rank memory."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        metrics = self.metrics
        depth = GaugeMetricFamily("tinker_queue_depth", "Requests waiting to run, per session (released and not "
                                  "started, or held back behind an earlier seq_id)", labels=["session"])
        for session, count in sorted(metrics.scheduler.depths().items()):
            depth.add_metric([session or "none"], count)
        yield depth
        pending, kept = metrics.scheduler.futures.counts()
        futures = GaugeMetricFamily("tinker_futures", "Futures held: pending, or finished and kept for "
                                    "retrieve_future", labels=["state"])
        futures.add_metric(["pending"], pending)
        futures.add_metric(["finished"], kept)
        yield futures
        yield GaugeMetricFamily("tinker_sessions", "Open sessions", value=metrics.open_sessions())
        rate = GaugeMetricFamily("tinker_tokens_per_second", f"Tokens per second over the last {TOKENS_WINDOW_S:g} s "
                                 "(train, forward, sample)", labels=["kind"])
        for kind, value in metrics.tokens_per_second().items():
            rate.add_metric([kind], value)
        yield rate
        memory = GaugeMetricFamily("tinker_rank_memory_bytes", "Each rank's memory: rss (the process), engines "
                                   "(parameters, gradients and optimizer state of its training engines), "
                                   "snapshots (the sampler snapshots it holds), device_allocated (CUDA)",
                                   labels=["rank", "kind"])
        try:
            per_rank = metrics.rank_memory()
        except Exception as e:  # a scrape must not fail on a rank that is gone
            log.warning("reading the ranks' memory failed: %s", e)
            per_rank = {}
        for rank, values in sorted(per_rank.items()):
            for kind, value in sorted(values.items()):
                if kind in MEMORY_KINDS:
                    memory.add_metric([str(rank), kind], value)
        yield memory


# ---------------------------------------------------------------------------------------------- rank memory


def engine_bytes(models: list[Any]) -> int:
    """Bytes of the tensors the training engines hold: parameters (ZeRO-3 partitions too), gradients, optimizer
    state and the optimizer's own parameter copies; each storage once (LoRA clients share their base model)."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer == 0 or pointer in seen:
            return
        seen.add(pointer)
        total += storage.nbytes()

    for model in models:
        engine = model.engine
        for parameter in engine.module.parameters():
            for tensor in (parameter.data, parameter.grad, getattr(parameter, "ds_tensor", None)):
                add(tensor)
        for optimizer in (engine.optimizer, getattr(engine.optimizer, "optimizer", None)):
            try:  # ZeRO's optimizers expose state and groups as properties: take what each has
                states = list(getattr(optimizer, "state", {}).values()) if optimizer is not None else []
                groups = list(getattr(optimizer, "param_groups", ())) if optimizer is not None else []
            except Exception:
                continue
            for state in states:
                for value in state.values() if isinstance(state, dict) else ():
                    add(value)
            for group in groups:
                for parameter in group.get("params", ()):
                    add(parameter)
                    add(getattr(parameter, "grad", None))
    return total


def rank_memory(worker: Any, counted: dict[str, float] | None = None) -> dict[str, float]:
    """This rank's memory now: process RSS and CUDA memory allocated, and the engines' tensors and sampler snapshots
    as last counted. Those are counted only while no command runs (``Worker.lock``: a command's C++ changes them
    without the GIL), so during one they keep their count from before it (before the first count, they are left
    out); ``counted`` carries that count from one report to the next. Nothing here waits for a command."""
    values: dict[str, float] = {"rss": float(psutil.Process().memory_info().rss), "time": time.time()}
    if worker.device.type == "cuda":
        import torch

        values["device_allocated"] = float(torch.cuda.memory_allocated(worker.device))
    counted = {} if counted is None else counted
    if worker.lock.acquire(blocking=False):
        try:
            counted["engines"] = float(engine_bytes(list(worker.models.values())))
            counted["snapshots"] = float(worker.samplers.held_bytes())
            counted["counted_at"] = time.time()
        finally:
            worker.lock.release()
    values.update(counted)
    return values


def release_free_memory() -> None:
    """Hand the memory the C allocator holds free back to the OS (glibc's ``malloc_trim``; elsewhere nothing): after
    an unload, so that a closed session's memory shows as returned in the process's RSS, not only as reusable."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _store() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def start_memory_reporter(worker: Any, every_s: float = MEMORY_EVERY_S) -> threading.Thread | None:
    """Every rank: write ``rank_memory`` to the process group's store every ``every_s`` (a daemon thread)."""
    store = _store()
    if store is None:
        return None
    key = MEMORY_KEY.format(rank=worker.rank)

    def report() -> None:
        counted: dict[str, float] = {}
        while True:
            try:
                store.set(key, json.dumps(rank_memory(worker, counted)))
            except Exception as e:  # the models changed under us, or the store is gone at shutdown
                log.debug("rank %d: memory report failed: %s", worker.rank, e)
            time.sleep(every_s)

    thread = threading.Thread(target=report, name="tinker-memory", daemon=True)
    thread.start()
    return thread


def read_rank_memory() -> dict[int, dict[str, float]]:
    """Rank 0: every rank's last memory report (ranks that have not reported yet are left out)."""
    import torch.distributed as dist

    store = _store()
    if store is None:
        return {}
    reports = {}
    for rank in range(dist.get_world_size()):
        key = MEMORY_KEY.format(rank=rank)
        if store.check([key]):
            reports[rank] = json.loads(store.get(key))
    return reports

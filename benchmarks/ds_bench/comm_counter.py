"""Count the collectives DeepSpeed issues, and their bytes, per operation type.

Every collective in ``deepspeed.comm`` (``all_reduce``, ``reduce_scatter_fn``, ``allgather_fn``, ...)
ends in one method call on the communication backend object ``deepspeed.comm.comm.cdb`` (a
``TorchBackend``). :class:`CommCounter` wraps those methods on that one object, so it sees every call
site however it imported ``deepspeed.comm`` (``from deepspeed import comm as dist``,
``from deepspeed.comm import all_to_all_single``), and counts each collective exactly once: the
backend's methods do not call one another.

DeepSpeed's own comms logger (ds_config ``"comms_logger"``) was not used as the counter: it
synchronizes the device after every collective (which changes what the benchmark times), skips
collectives that are not decorated with ``timed_op`` (``all_gather_coalesced``), files
``all_reduce_coalesced`` and ``inference_all_reduce`` under ``all_reduce``, and divides by each op's
measured latency, which can be zero for tiny CPU collectives.

Bytes are the size of the collective's full (unsharded) buffer on one rank: the tensor of an
``all_reduce``, ``broadcast`` or ``reduce``; the input of a ``reduce_scatter``; the output of an
``all_gather``; the input of an ``all_to_all``. Object collectives and barriers count 0 bytes.
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Callable

import torch


def _nbytes(value) -> int:
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


#: Backend method -> name of the argument whose size is the collective's payload (None: 0 bytes).
PAYLOAD_ARGUMENT: dict[str, str | None] = {
    "all_reduce": "tensor",
    "inference_all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "reduce": "tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input_tensor",
    "broadcast": "tensor",
    "broadcast_object_list": None,
    "all_gather": "tensor_list",
    "all_gather_into_tensor": "output_tensor",
    "all_gather_base": "output_tensor",
    "all_gather_coalesced": "output_tensors",
    "all_gather_object": None,
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "monitored_barrier": None,
}


#: Position of the payload among a backend method's arguments (after ``self``), for methods whose decorator hides
#: their signature (0.19.8's ``stage_on_cpu`` wrapper takes ``*args, **kwargs``).
PAYLOAD_POSITION: dict[str, int] = {
    "reduce_scatter": 1,
    "reduce_scatter_tensor": 1,
    "all_to_all_single": 1,
    "all_to_all": 1,
}


def _payload(signature: inspect.Signature, name: str, payload: str, args: tuple, kwargs: dict):
    """The payload argument of a call, by name where the signature names it, else by keyword or position."""
    try:
        arguments = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        arguments = {}
    if payload in arguments:
        return arguments[payload]
    if payload in kwargs:
        return kwargs[payload]
    position = PAYLOAD_POSITION.get(name, 0)
    return args[position] if len(args) > position else None


class CommCounter:
    """Calls and bytes per collective type issued through ``deepspeed.comm``.

    Use as a context manager (or :meth:`install` / :meth:`uninstall`) once ``deepspeed.comm`` is
    initialized. Counting can be paused, so the benchmark's own synchronization is not counted::

        with CommCounter() as counter:
            engine.backward(loss)
            engine.step()
        counter.snapshot()  # {"all_reduce": {"calls": 3, "bytes": 16908288}}
    """

    def __init__(self, backend=None):
        self._backend = backend
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}
        self._installed = []
        self._paused = 0

    # -- installation -------------------------------------------------------------------------------------
    def install(self) -> CommCounter:
        if self._installed:
            return self
        backend = self._backend
        if backend is None:
            import deepspeed.comm.comm as ds_comm
            backend = ds_comm.cdb
        if backend is None:
            raise RuntimeError("deepspeed.comm is not initialized; call deepspeed.init_distributed() first")
        self._backend = backend
        for name, payload in PAYLOAD_ARGUMENT.items():
            method = getattr(backend, name, None)
            if method is None or not callable(method):
                continue
            setattr(backend, name, self._wrap(name, payload, method))
            self._installed.append(name)
        return self

    def uninstall(self) -> None:
        for name in self._installed:
            # The wrappers live in the instance's __dict__; removing them uncovers the class's methods.
            self._backend.__dict__.pop(name, None)
        self._installed = []

    def __enter__(self) -> CommCounter:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _wrap(self, name: str, payload: str | None, method: Callable) -> Callable:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def counted(*args, **kwargs):
            if not self._paused:
                size = 0
                if payload is not None:
                    size = _nbytes(_payload(signature, name, payload, args, kwargs))
                self._record(name, size)
            return method(*args, **kwargs)

        counted.__comm_counter__ = self
        return counted

    def _record(self, name: str, size: int) -> None:
        with self._lock:
            entry = self._counts.setdefault(name, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += size

    # -- reading ------------------------------------------------------------------------------------------
    @contextmanager
    def paused(self):
        """Do not count collectives issued inside the block (the benchmark's own barriers)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def reset(self) -> None:
        with self._lock:
            self._counts = {}

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of the counts so far: ``{op: {"calls": n, "bytes": b}}``, ops sorted by name."""
        with self._lock:
            return {name: dict(self._counts[name]) for name in sorted(self._counts)}

    def totals(self) -> dict[str, int]:
        snap = self.snapshot()
        return {"calls": sum(v["calls"] for v in snap.values()), "bytes": sum(v["bytes"] for v in snap.values())}


def subtract(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per-entry difference of two snapshots (``{name: {"calls": ..., "bytes": ...}}``, or any numeric fields, as
    :class:`ds_bench.method_timer.MethodTimer`'s), dropping entries that did not change."""
    out = {}
    for name in sorted(set(after) | set(before)):
        a, b = after.get(name, {}), before.get(name, {})
        diff = {key: a.get(key, 0) - b.get(key, 0) for key in list(a) + [k for k in b if k not in a]}
        if any(diff.values()):
            out[name] = diff
    return out

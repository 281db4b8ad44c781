"""The ZeRO and offload configurations the benchmark compares, and the ways of driving them (see logical_step).

A configuration names a ZeRO stage and an offload mode. For each configuration and micro-batch count
N, the same ds_config (``gradient_accumulation_steps = N``) is driven three ways, which differ only
in the training loop and, for (b), in the flag:

* ``managed`` (a): forward, backward and ``step()`` on every micro-batch; DeepSpeed's micro-step
  counter decides that the N-th ``step()`` is the boundary.
* ``unmanaged`` (b): ``"managed_gradient_accumulation": false``; N forward/backward pairs, then one
  ``step()``.
* ``toggle`` (c): today's workaround: ``set_gradient_accumulation_boundary(i == N - 1)`` before each
  micro-batch, ``step()`` after each backward (it only updates at the boundary).

All three call ``backward(loss / N, scale_wrt_gas=False)``, so they compute the same update.
"""

from __future__ import annotations

from dataclasses import dataclass

FLAG = "managed_gradient_accumulation"

MANAGED = "managed"
UNMANAGED = "unmanaged"
TOGGLE = "toggle"
MODES = (MANAGED, UNMANAGED, TOGGLE)
MODE_LETTER = {MANAGED: "a", UNMANAGED: "b", TOGGLE: "c"}
#: (d), timed against (b) only: unmanaged with raw losses and ``step(gradient_divide_factor=N * world)``,
#: the same update as (b) with the normaliser applied once per step instead of to every loss
#: (`gradient-divide-factor`).
FACTOR = "unmanaged_factor"


@dataclass(frozen=True)
class Configuration:
    """A ZeRO stage with an offload mode. ``offload_optimizer``/``offload_param``: None, "cpu" or "nvme"."""

    name: str
    stage: int
    offload_optimizer: str | None = None
    offload_param: str | None = None
    #: Why the configuration is not run by default on a device (``{"cpu": reason}``); naming it in
    #: ``--configs`` runs it anyway.
    skip_on: dict[str, str] | None = None

    @property
    def offload(self) -> str:
        parts = []
        if self.offload_optimizer:
            parts.append(f"optimizer→{self.offload_optimizer}")
        if self.offload_param:
            parts.append(f"params→{self.offload_param}")
        return ", ".join(parts) or "none"

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    @property
    def uses_cpu_adam(self) -> bool:
        return self.offload_optimizer is not None


#: Measured on DeepSpeed 0.19.3 with its CPU accelerator (a model whose optimizer state is actually swapped).
NVME_ON_CPU = ("DeepSpeed 0.19.3 aborts while building the engine, in managed mode too: the CPU accelerator "
               "cannot pin memory, so PartitionedOptimizerSwapper._swap_out_optimizer_state submits no write "
               "and then waits (assertion `_num_pending_ops > 0` in deepspeed_py_io_handle.cpp)")
_NOT_ON_CPU = {"cpu": NVME_ON_CPU}

CONFIGURATIONS: list[Configuration] = [
    Configuration("z0", 0),
    Configuration("z1", 1),
    Configuration("z2", 2),
    Configuration("z3", 3),
    Configuration("z1-opt-cpu", 1, offload_optimizer="cpu"),
    Configuration("z2-opt-cpu", 2, offload_optimizer="cpu"),
    Configuration("z3-opt-cpu", 3, offload_optimizer="cpu"),
    Configuration("z3-opt-param-cpu", 3, offload_optimizer="cpu", offload_param="cpu"),
    Configuration("z3-opt-nvme", 3, offload_optimizer="nvme", skip_on=_NOT_ON_CPU),
    Configuration("z3-opt-param-nvme", 3, offload_optimizer="nvme", offload_param="nvme", skip_on=_NOT_ON_CPU),
]
BY_NAME: dict[str, Configuration] = {c.name: c for c in CONFIGURATIONS}

#: Bucket sizes (elements) small enough that the ~4M-parameter model spans several buckets, so the
#: counts exercise bucketing rather than one collective per step.
BUCKET_ELEMENTS = 1_000_000


def ds_config(configuration: Configuration,
              mode: str,
              n_micro: int,
              micro_batch: int,
              world_size: int,
              dtype: str = "fp32",
              nvme_path: str | None = None,
              bucket_elements: int = BUCKET_ELEMENTS) -> dict:
    """The ds_config for one trial. Only ``unmanaged`` sets the flag; the others leave the default."""
    zero: dict = {"stage": configuration.stage}
    if configuration.stage >= 1:
        zero.update({"reduce_bucket_size": bucket_elements, "allgather_bucket_size": bucket_elements})
    if configuration.stage == 3:
        zero.update({"stage3_prefetch_bucket_size": bucket_elements, "stage3_param_persistence_threshold": 10_000})
    offload = {"offload_optimizer": configuration.offload_optimizer, "offload_param": configuration.offload_param}
    for key, device in offload.items():
        if device:
            entry = {"device": device}
            if device == "nvme":
                if nvme_path is None:
                    raise ValueError(f"{configuration.name} needs an nvme_path")
                entry["nvme_path"] = nvme_path
            zero[key] = entry
    optimizer_params = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    if not configuration.uses_cpu_adam:
        # torch's Adam: no JIT-built op is needed where nothing is offloaded.
        optimizer_params["torch_adam"] = True
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": n_micro,
        "train_batch_size": micro_batch * n_micro * world_size,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "Adam",
            "params": optimizer_params
        },
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if mode in (UNMANAGED, FACTOR):
        config[FLAG] = False
    return config


# -- the training loops --------------------------------------------------------------------------------------
def logical_step(mode: str, engine, batches, n_micro: int):
    """One logical step of ``n_micro`` micro-batches driven the way ``mode`` says; returns the summed loss.

    (a) managed: ``step()`` after every backward, DeepSpeed's counter makes the N-th one the update;
    (b) unmanaged: N backwards, then exactly one ``step()``; (c) toggle: the boundary set by hand before
    each micro-batch, ``step()`` after each; (d) factor: raw losses, then
    ``step(gradient_divide_factor=N * world)``. (a)-(c) divide each loss by N, so all four compute the
    same update.
    """
    caller_owns_boundary = mode in (UNMANAGED, FACTOR)
    total = 0.0
    for index, tokens in enumerate(batches):
        if mode == TOGGLE:
            engine.set_gradient_accumulation_boundary(index == n_micro - 1)
        loss = engine(tokens)
        engine.backward(loss if mode == FACTOR else loss / n_micro, scale_wrt_gas=False)
        if not caller_owns_boundary:
            engine.step()
        total += loss.detach()
    if mode == FACTOR:
        engine.step(gradient_divide_factor=n_micro * engine.dp_world_size)
    elif mode == UNMANAGED:
        engine.step()
    return total

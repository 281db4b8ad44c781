"""The DeepSpeed side: one engine per training model, on every rank, in unmanaged mode.

Every rank runs every command in the same order (rank 0 broadcasts them, ``commands`` maps each kind to a method
here), so collectives line up.
A ``forward_backward`` request is split into contiguous shares of its datums, one per rank, and
ends in exactly one ``engine.backward(loss_sum, scale_wrt_gas=False)`` per rank; an
``optim_step`` is one ``engine.step()`` whose gradient is the plain SUM over ranks and requests.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .checkpoint_files import copy_tokenizer, encrypt_files, fsync_path, fsync_tree, write_weights
from .errors import UserError
from .jobs import AdamParams, LoadWeights, SaveExternal, SaveSampler, SaveWeights
from .losses import LossInputs, elementwise_loss
from .metrics import release_free_memory
from .model import (
    BASE_MODELS,
    DTYPES,
    build_base,
    build_model,
    enable_gradient_checkpointing,
    token_logprobs,
    zero3_construction,
)
from .sampler import SAMPLER_META_FILE, SamplerPool, capture_weights
from .sampling import SampleJob
from .wire import Datum, FwdBwdRequest

CHECKPOINT_TAG = "state"
META_FILE = "tinker_meta.json"


def ds_config(zero_stage: int, dtype: str = "fp32") -> dict[str, Any]:
    """Unmanaged mode, torch's AdamW; hyper-parameters are overwritten before every step. ``bf16``: DeepSpeed's
    bf16 mode (bf16 weights and gradients in the model, fp32 master weights and Adam state in the optimizer)."""
    zero: dict[str, Any] = {"stage": zero_stage}
    precision = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    return {
        **precision,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-12,
                                                    "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": zero,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; clipping is per step here
        "steps_per_print": 2**31 - 1,
    }


def sum_over_ranks(engine: Any) -> tuple[float, dict[str, float]]:
    """(loss multiplier, ``step()`` kwargs) that make the applied gradient the plain SUM over ranks.

    ``step(gradient_divide_factor=1.0)`` says so directly where the series has it; otherwise
    step() averages over the data-parallel world, which multiplying each loss by that size undoes.
    """
    if "gradient_divide_factor" in inspect.signature(engine.step).parameters:
        return 1.0, {"gradient_divide_factor": 1.0}
    return float(engine.dp_world_size), {}


def apply_step_hyperparameters(engine: Any, adam: AdamParams) -> None:
    """Set this step's AdamW hyper-parameters and clip norm (tinker sends them with every step).

    DeepSpeed reads the clip norm from its config at step time without ZeRO, and from the ZeRO
    optimizer's ``clip_grad`` with it; both are set.
    """
    for group in engine.optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["betas"] = (adam.beta1, adam.beta2)
        group["eps"] = adam.eps
        group["weight_decay"] = adam.weight_decay
    engine._config.gradient_clipping = adam.grad_clip_norm
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = adam.grad_clip_norm


def share(n: int, rank: int, world_size: int) -> range:
    """The contiguous slice of ``n`` datums this rank runs (earlier ranks take the remainder)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def pad_inputs(data: list[Datum]) -> tuple[torch.Tensor, LossInputs]:
    """Right-padded tokens and loss inputs; padding has mask 0, so it adds nothing to any loss.

    When a datum has ``[N, K]`` targets, targets and weights are ``[B, T, K_max]``: ``[N]`` datums take
    slot 0 and every unused slot has weight 0.
    """
    if not data:  # an idle rank still runs a forward: ZeRO-3 gathers parameters collectively
        zeros = torch.zeros(1, 1)
        return torch.zeros(1, 1, dtype=torch.long), LossInputs(torch.zeros(1, 1, dtype=torch.long), zeros, zeros,
                                                               zeros, zeros, zeros)
    length = max(len(d.tokens) for d in data)
    k = max((d.targets.shape[1] for d in data if d.targets.ndim == 2), default=0)
    tokens = torch.zeros(len(data), length, dtype=torch.long)
    targets = torch.zeros(len(data), length, *([k] if k else []), dtype=torch.long)
    weights = torch.zeros(targets.shape)
    sampling, advantages, mask, ratio_mask = (torch.zeros(len(data), length) for _ in range(4))
    for i, d in enumerate(data):
        n = len(d.tokens)
        tokens[i, :n] = torch.from_numpy(d.tokens)
        where: tuple = (i, slice(0, n))
        if k:  # [N, K] targets fill their K slots, [N] targets slot 0
            where += (slice(0, d.targets.shape[1]) if d.targets.ndim == 2 else 0, )
        targets[where] = torch.from_numpy(d.targets)
        weights[where] = torch.from_numpy(d.weights)
        mask[i, :n] = 1.0
        for padded, values in ((sampling, d.sampling_logprobs), (advantages, d.advantages),
                               (ratio_mask, d.sequence_ratio_mask)):
            if values is not None:
                padded[i, :n] = torch.from_numpy(values)
    return tokens, LossInputs(targets, weights, sampling, advantages, mask, ratio_mask)


def unpad(values: torch.Tensor, datum: Datum, row: int) -> np.ndarray:
    """Datum ``row``'s part of a padded ``[B, T]`` or ``[B, T, K]`` output, in the shape of its targets."""
    n = len(datum.tokens)
    if values.dim() == 2:
        return values[row, :n].numpy().copy()
    return (values[row, :n, :datum.targets.shape[1]] if datum.targets.ndim == 2 else values[row, :n, 0]).numpy().copy()


def pad_batch(data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (tokens, targets, weights); padding has weight 0 so it adds nothing."""
    tokens, inputs = pad_inputs(data)
    return tokens, inputs.targets, inputs.weights


def _to(inputs: LossInputs, device: torch.device) -> LossInputs:
    return LossInputs(*(t.to(device) for t in (inputs.targets, inputs.weights, inputs.sampling_logprobs,
                                                inputs.advantages, inputs.mask, inputs.sequence_ratio_mask)))


@dataclass
class TrainingModel:
    engine: Any
    lora: Any = None  # the LoraSpec, or None for full fine-tuning
    base_model: str = ""
    requests: int = 0  # forward_backward requests accumulated since the last step
    datums: int = 0
    steps: int = 0
    #: Changes whenever the weights do (optim_step, load_weights): snapshots of one version share their tensors.
    version: int = 0
    #: (version, tensors) of this model's latest sampler snapshot.
    last_snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
    #: Its unnamed sampler snapshots (only its own session's samplers use them): its unload drops them.
    snapshot_ids: set[str] = field(default_factory=set)


class Worker:
    """This rank's engines and samplers; each method is this rank's part of one command (``commands.COMMANDS``
    says which kind runs which)."""

    def __init__(self, rank: int, world_size: int, zero_stage: int, device: torch.device | None = None,
                 dtype: str = "fp32", gradient_checkpointing: bool = False,
                 snapshots: tuple[int, int] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.zero_stage = zero_stage
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.models: dict[str, TrainingModel] = {}
        #: One frozen base model per served model, shared by every LoRA client of it (``_module_for``).
        self.bases: dict[str, torch.nn.Module] = {}
        self.samplers = SamplerPool(self.device, DTYPES[dtype], *(snapshots or ()))
        #: Held while a command runs. Another thread (the memory reporter) reads the engines' tensors only under it:
        #: a command's C++ (autograd, the optimizer, collectives) changes tensors and frees storages without the GIL,
        #: and a storage read from another thread meanwhile can be a use after free (a rank died of that in
        #: ``release_resources`` of a ``StorageImpl``).
        self.lock = threading.Lock()

    def model(self, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            raise RuntimeError(f"model {model_id} is not loaded on rank {self.rank}")
        return model

    def unload(self, model_id: str) -> dict[str, Any]:
        gone = self.models.pop(model_id, None)
        if gone is not None:
            # Removes the optimizer's gradient hooks (held by autograd, out of the garbage collector's sight), which
            # otherwise keep the engine and all its tensors alive.
            gone.engine.destroy()
            self.samplers.drop(gone.snapshot_ids)
        if gone is not None and not any(m.base_model == gone.base_model and m.lora is not None
                                        for m in self.models.values()):
            self.bases.pop(gone.base_model, None)  # its last LoRA client is gone
        gc.collect()
        release_free_memory()
        return {}

    def prepare_save(self, model_id: str, job: SaveWeights) -> None:
        """Rank 0, before broadcasting a save: refuse early, and never clobber a checkpoint unasked."""
        if model_id in self.models:
            self._refuse_pending(self.models[model_id], "save_weights")
        directory = Path(job.dir)
        if directory.exists():
            if not job.overwrite:
                raise UserError(f"checkpoint {job.path} exists (pass overwrite=True to replace it)")
            shutil.rmtree(directory)
        directory.mkdir(parents=True)

    def create(self, model_id: str, record: Any) -> dict[str, Any]:
        import deepspeed

        config = ds_config(self.zero_stage, self.dtype)
        module = self._module_for(record, config)
        if self.gradient_checkpointing:
            enable_gradient_checkpointing(module)
        trainable = [p for p in module.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=trainable, config=config)
        if getattr(engine, "managed_gradient_accumulation", lambda: True)():
            raise RuntimeError("this DeepSpeed does not run in unmanaged mode; install the patch series")
        self.models[model_id] = TrainingModel(engine, record.lora, record.base_model)
        return {"model_id": model_id, "type": "create_model"}

    def _module_for(self, record: Any, config: dict[str, Any]) -> torch.nn.Module:
        """The module a new engine trains. A LoRA client gets its own adapters over the ONE frozen base model of its
        ``base_model`` that every LoRA client of it shares (the same tensors, never a copy; see ``share_frozen``);
        full fine-tuning trains the base weights, so it gets its own copy. Under ZeRO-3 the base is built sharded
        (``zero3_construction``; a built-in byte model is built whole, DeepSpeed partitions it); the adapters are added
        outside it, whole, and the engine partitions them."""
        dtype = DTYPES[self.dtype]
        sharded = self.zero_stage == 3 and BASE_MODELS[record.base_model].path is not None  # built-ins: toy sizes
        construction = zero3_construction(config) if sharded else contextlib.nullcontext()
        if record.lora is None:
            with construction:
                return build_base(record.base_model, dtype)
        base = self.bases.get(record.base_model)
        if base is None:
            with construction:
                base = self.bases[record.base_model] = build_base(record.base_model, dtype)
            base.requires_grad_(False)
        return build_model(record.base_model, record.lora, dtype, base=base)

    def forward_backward(self, model_id: str, request: FwdBwdRequest) -> list[tuple[np.ndarray, np.ndarray]]:
        model = self.model(model_id)
        mine = [request.data[i] for i in share(len(request.data), self.rank, self.world_size)]
        tokens, inputs = pad_inputs(mine)
        tokens, inputs = tokens.to(self.device), _to(inputs, self.device)
        engine = model.engine
        with torch.set_grad_enabled(not request.forward_only):
            logprobs = token_logprobs(engine, tokens, inputs.targets)
            losses = elementwise_loss(request.loss_fn, logprobs, inputs, request.loss_config)
        if not request.forward_only:
            multiplier, _ = sum_over_ranks(engine)
            engine.backward(losses.sum() * multiplier, scale_wrt_gas=False)
            model.requests += 1
            model.datums += len(request.data)
        logprobs, losses = logprobs.detach().float().cpu(), losses.detach().float().cpu()
        return [(unpad(logprobs, d, i), unpad(losses, d, i)) for i, d in enumerate(mine)]

    def optim_step(self, model_id: str, adam: AdamParams) -> dict[str, Any]:
        model = self.model(model_id)
        if model.requests == 0:  # same count on every rank, so every rank refuses together
            raise UserError("optim_step without a forward_backward since the previous optim_step: "
                            "no gradient to apply")
        engine = model.engine
        apply_step_hyperparameters(engine, adam)
        _, step_kwargs = sum_over_ranks(engine)
        engine.step(**step_kwargs)
        model.steps += 1
        model.version += 1
        metrics = {"fwdbwd_requests:sum": float(model.requests), "datums:sum": float(model.datums),
                   "optim_steps:max": float(model.steps)}
        model.requests = model.datums = 0
        return {"metrics": metrics, "type": "optim_step"}

    @staticmethod
    def _refuse_pending(model: TrainingModel, what: str) -> None:
        if model.requests:
            raise UserError(f"{what} with {model.requests} forward_backward request(s) since the last optim_step "
                            "would drop their gradients: call optim_step first")

    def save_weights(self, model_id: str, job: SaveWeights) -> dict[str, Any]:
        """DeepSpeed's checkpoint (the state to resume from: optimizer, step count) under ``state/``, and the
        weights as safetensors (``checkpoint_files``) beside it."""
        model = self.model(model_id)
        self._refuse_pending(model, "save_weights")
        directory = Path(job.dir)
        engine = model.engine
        engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state={"tinker_steps": model.steps})
        weights = capture_weights(engine, self.zero_stage, trainable_only=model.lora is not None)
        if self.rank == 0:
            write_weights(directory, engine.module, weights, job.meta.base_model)
            fsync_tree(directory)
            # written last: its presence marks a complete checkpoint
            meta = dict(job.meta.to_json(), zero_stage=self.zero_stage, world_size=self.world_size, steps=model.steps)
            (directory / META_FILE).write_text(json.dumps(meta, indent=1))
        # Durable before rank 0 records it and acknowledges the save: every rank's DeepSpeed files are on disk.
        fsync_tree(directory)
        return {"path": job.path, "type": "save_weights"}

    def load_weights(self, model_id: str, job: LoadWeights) -> dict[str, Any]:
        model = self.model(model_id)
        self._refuse_pending(model, "load_weights")
        engine = model.engine
        _, client_state = engine.load_checkpoint(job.dir, tag=CHECKPOINT_TAG, load_optimizer_states=job.optimizer,
                                                 load_lr_scheduler_states=False, load_module_only=not job.optimizer)
        if job.optimizer and client_state:
            model.steps = int(client_state.get("tinker_steps", 0))
        model.version += 1
        return {"path": job.path, "type": "load_weights"}

    def save_sampler(self, model_id: str, job: SaveSampler) -> dict[str, Any]:
        """Snapshot the current weights for sampling (a collective under ZeRO-3); rank 0 writes a named one.

        Weights unchanged since this model's last snapshot (no optim_step or load between) are not gathered again:
        the new snapshot shares the last one's tensors. The version is the same on every rank (it depends on the
        commands alone, not on what a rank's sampler pool still holds), so every rank skips the collective together."""
        model = self.model(model_id)
        if model.last_snapshot is not None and model.last_snapshot[0] == model.version:
            weights = model.last_snapshot[1]
        else:
            weights = capture_weights(model.engine, self.zero_stage, trainable_only=model.lora is not None)
        self.samplers.keep(job.snapshot_id, weights)
        model.last_snapshot = (model.version, weights)
        if job.dir is None:
            model.snapshot_ids.add(job.snapshot_id)
        elif self.rank == 0:
            with replacing(Path(job.dir)) as directory:
                write_weights(directory, model.engine.module, weights, job.meta.base_model)
                (directory / SAMPLER_META_FILE).write_text(json.dumps(job.meta.to_json(), indent=1))
        return job.reply

    def save_external(self, model_id: str, job: SaveExternal) -> dict[str, Any]:
        """The weights in Hugging Face formats for download: a PEFT adapter, or a model directory with its
        tokenizer; each file age-encrypted to ``<name>.age`` when the client sent recipients."""
        model = self.model(model_id)
        weights = capture_weights(model.engine, self.zero_stage, trainable_only=model.lora is not None)
        if self.rank == 0:
            with replacing(Path(job.dir)) as directory:
                write_weights(directory, model.engine.module, weights, job.served_name)
                if model.lora is None:
                    copy_tokenizer(Path(job.tokenizer_dir) if job.tokenizer_dir else None, directory)
                if job.recipients:
                    encrypt_files(directory, list(job.recipients))
        return job.reply

    def sample(self, job: SampleJob) -> dict[str, Any]:
        return self.samplers.sample(job, share(job.num_samples, self.rank, self.world_size), self.rank == 0)

    def sample_many(self, jobs: tuple[SampleJob, ...]) -> list[tuple[str, Any]]:
        """Concurrent sampling requests decoded as one batch; per job ``("ok", part)`` or a user error."""
        return self.samplers.sample_many(list(jobs), [share(j.num_samples, self.rank, self.world_size) for j in jobs],
                                         self.rank == 0)


@contextlib.contextmanager
def replacing(directory: Path) -> Iterator[Path]:
    """Write a directory under a temporary name and swap it in whole, so no reader sees it half written."""
    staging = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_tree(staging)  # on disk before it is swapped in, recorded and acknowledged
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    fsync_path(directory.parent)

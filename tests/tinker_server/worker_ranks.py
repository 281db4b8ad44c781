"""One rank of a real 2-rank run of the server's ``Worker`` (real DeepSpeed engines, real gloo), for
``test_real_models.py``: ``python tests/tinker_server/worker_ranks.py OUT_DIR ZERO_STAGE DTYPE MODEL_DIR``
with the launcher environment (RANK, WORLD_SIZE, MASTER_*) set. Each rank writes what it saw to
``OUT_DIR/rank<r>.json``; the test asserts on it.

What it does, with the Worker exactly as the server drives it (commands in the same order on every rank):

1. ``precision``: a LoRA client and a full fine-tuning client of MODEL_DIR, each created twice, without and
   with gradient checkpointing; the dtype of every parameter; one ``forward_backward`` and one ``optim_step``
   on the same datums; how often layer 0's attention ran (1 per forward, 2 with checkpointing: the recompute);
   the logprobs, losses and weights after the step, without and with checkpointing.
2. ``sharding`` (ZeRO-3): for every parameter of the full fine-tuning client right after it loads, its full size,
   its partition on this rank and the data the rank holds; the gathered weights against the checkpoint file.
3. ``shared_base``: the LoRA clients' frozen base tensors (the same objects? the same storage?), and whether a
   step of one LoRA client changed another's logprobs.
4. ``snapshots`` (ZeRO-3): the most parameter elements held gathered at once while sampler snapshots of the full
   fine-tuning client are taken (per module, and with the default bucket), against the whole model's and the
   largest module's; whether the snapshots equal one whole-model gather bit for bit; whether a snapshot of unchanged
   weights shares the last one's tensors without a gather; what the pool holds under a byte budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from deepspeed_tinker.wire import Datum, FwdBwdRequest


def main(out_dir: Path, zero_stage: int, dtype: str, model_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from local_ranks.ranks import init_gloo_deepspeed

    init_gloo_deepspeed(timeout_minutes=10)

    from deepspeed_tinker.api import ModelRecord
    from deepspeed_tinker.commands import run_command
    from deepspeed_tinker.jobs import AdamParams, JobKind
    from deepspeed_tinker.model import LoraSpec, register_local_model
    from deepspeed_tinker.sampler import capture_weights
    from deepspeed_tinker.worker import Worker

    spec = register_local_model(model_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    worker = Worker(rank, world, zero_stage, dtype=dtype)
    rng = np.random.default_rng(0)
    data = tuple(Datum(t[:-1].astype(np.int64), t[1:].astype(np.int64), np.ones(len(t) - 1, np.float32))
                 for t in (rng.integers(0, 256, n) for n in (9, 14, 6, 11)))
    adam = AdamParams(learning_rate=1e-2, eps=1e-8)
    report: dict = {"rank": rank, "world": world}

    def inner(model_id: str) -> torch.nn.Module:
        module = worker.models[model_id].engine.module
        return module.get_base_model() if hasattr(module, "get_base_model") else module

    def create(model_id: str, lora: LoraSpec | None, checkpointing: bool) -> None:
        worker.gradient_checkpointing = checkpointing
        run_command(worker, JobKind.CREATE, model_id, ModelRecord(model_id, "s", spec.name, lora))

    def layer0_calls(model_id: str) -> list[int]:
        calls = [0]
        inner(model_id).model.layers[0].self_attn.register_forward_hook(
            lambda *_: calls.__setitem__(0, calls[0] + 1))
        return calls

    def step(model_id: str) -> dict:
        calls = layer0_calls(model_id)
        request = FwdBwdRequest(model_id, 0, "cross_entropy", False, data)
        part = run_command(worker, JobKind.FORWARD_BACKWARD, model_id, request)
        during = calls[0]
        run_command(worker, JobKind.OPTIM_STEP, model_id, adam)
        weights = capture_weights(worker.models[model_id].engine, zero_stage,
                                  trainable_only=worker.models[model_id].lora is not None)
        return {"layer0_attention_calls": during,
                "logprobs": [lp.tolist() for lp, _ in part], "losses": [loss.tolist() for _, loss in part],
                "weights": {n: w.float().flatten().tolist() for n, w in sorted(weights.items())}}

    # 2. sharded loading, checked before anything else touches the parameters
    create("full", None, False)
    if zero_stage == 3:
        params = []
        for name, p in worker.models["full"].engine.module.named_parameters():
            params.append({"name": name, "ds_numel": int(p.ds_numel), "partition": int(p.ds_tensor.numel()),
                           "held": int(p.numel()), "persist": bool(getattr(p, "ds_persist", False))})
        report["sharding"] = {"params": params,
                              "threshold": worker.models["full"].engine.zero_param_persistence_threshold()}
    gathered = capture_weights(worker.models["full"].engine, zero_stage, trainable_only=False)
    if rank == 0:
        from safetensors.torch import load_file

        on_disk = load_file(str(Path(model_dir) / "model.safetensors"))
        report["loaded_equals_checkpoint"] = all(
            torch.equal(gathered[name].float(), on_disk[name].to(gathered[name].dtype).float())
            for name in on_disk)
        report["loaded_names"] = sorted(on_disk)

    # 1. dtype and gradient checkpointing
    lora = LoraSpec(rank=4, seed=3)
    create("full-ckpt", None, True)
    create("lora", lora, False)
    create("lora-ckpt", lora, True)
    report["dtypes"] = {mid: sorted({str(p.dtype) for p in worker.models[mid].engine.module.parameters()})
                        for mid in ("full", "full-ckpt", "lora", "lora-ckpt")}
    report["bf16_enabled"] = bool(worker.models["lora"].engine.bfloat16_enabled())
    report["checkpointing_flags"] = {mid: bool(getattr(inner(mid), "is_activation_checkpointing", None)
                                         if hasattr(type(inner(mid)), "is_activation_checkpointing")
                                         else inner(mid).is_gradient_checkpointing)
                                     for mid in ("full", "full-ckpt", "lora", "lora-ckpt")}

    # 3. the LoRA clients' base: one copy
    def base_tensors(model_id: str) -> dict[str, torch.Tensor]:
        return {n: p for n, p in worker.models[model_id].engine.module.named_parameters() if not p.requires_grad}

    a, b = base_tensors("lora"), base_tensors("lora-ckpt")
    storage = (lambda p: p.ds_tensor.data_ptr()) if zero_stage == 3 else (lambda p: p.data_ptr())
    report["shared_base"] = {"names": len(a), "same_names": sorted(a) == sorted(b),
                             "same_objects": all(a[n] is b[n] for n in a),
                             "same_storage": all(storage(a[n]) == storage(b[n]) for n in a),
                             "full_ft_shares": any(p is q for p in base_tensors("full").values()
                                                   for q in a.values())}
    forward = FwdBwdRequest("lora-ckpt", 0, "cross_entropy", True, data)
    before = run_command(worker, JobKind.FORWARD, "lora-ckpt", forward)

    report["steps"] = {mid: step(mid) for mid in ("full", "full-ckpt", "lora")}
    after = run_command(worker, JobKind.FORWARD, "lora-ckpt", forward)
    report["other_lora_unchanged"] = all(np.array_equal(x[0], y[0]) for x, y in zip(before, after))
    report["steps"]["lora-ckpt"] = step("lora-ckpt")
    if zero_stage == 3:
        report["snapshots"] = snapshots(worker, "full")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def snapshots(worker, model_id: str) -> dict:
    """Section 4 of the module docstring, on a ZeRO-3 engine."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from deepspeed_tinker import sampler
    from deepspeed_tinker.commands import run_command
    from deepspeed_tinker.jobs import AdamParams, JobKind, SaveSampler
    from deepspeed_tinker.sampler import capture_weights, tensor_bytes

    engine = worker.models[model_id].engine
    sharded = [p for p in engine.module.parameters() if not getattr(p, "ds_persist", False)]
    gathers, peak = [0], [0]
    whole = deepspeed.zero.GatheredParameters

    class Watched(whole):  # the real gather, counting what is whole at once right after each
        def __enter__(self):
            entered = super().__enter__()
            gathers[0] += 1
            peak[0] = max(peak[0], sum(p.ds_numel for p in sharded if p.ds_status == ZeroParamStatus.AVAILABLE))
            return entered

    with whole(list(engine.module.parameters()), modifier_rank=None):  # the old way: everything at once
        reference = {n: p.detach().to("cpu", copy=True) for n, p in engine.module.named_parameters()}
    deepspeed.zero.GatheredParameters = Watched
    try:
        per_module = capture_weights(engine, 3, trainable_only=False, bucket_numel=0)
        peak_per_module, peak[0] = peak[0], 0
        default = capture_weights(engine, 3, trainable_only=False)
        peak_default = peak[0]
        ids = {id(p) for p in sharded}
        module_sizes = [sum(p.ds_numel for p in m.parameters(recurse=False) if id(p) in ids)
                        for m in engine.module.modules()]
        pool = worker.samplers
        gathers[0] = 0
        for snapshot_id in ("a", "b"):  # no step between: one gather, shared tensors
            run_command(worker, JobKind.SAVE_SAMPLER, model_id, SaveSampler(snapshot_id, {}))
        gathers_for_two = gathers[0]
        shared = all(pool._snapshots["a"][n] is pool._snapshots["b"][n] for n in pool._snapshots["a"])
        one_snapshot = tensor_bytes(pool._snapshots["a"].values())
        bytes_two = pool.held_bytes()
        pool.max_bytes = one_snapshot * 3 // 2  # room for one snapshot's tensors, not two
        data = FwdBwdRequest(model_id, 0, "cross_entropy", False,
                             (Datum(np.arange(8, dtype=np.int64), np.arange(1, 9, dtype=np.int64),
                                    np.ones(8, np.float32)), ))
        run_command(worker, JobKind.FORWARD_BACKWARD, model_id, data)
        run_command(worker, JobKind.OPTIM_STEP, model_id, AdamParams(learning_rate=1e-2, eps=1e-8))
        run_command(worker, JobKind.SAVE_SAMPLER, model_id, SaveSampler("c", {}))
        held_after_step = sorted(pool._snapshots)
        changed = any(not torch.equal(pool._snapshots["c"][n], reference[n]) for n in reference)
    finally:
        deepspeed.zero.GatheredParameters = whole
    return {"total": sum(p.ds_numel for p in sharded), "largest_module": max(module_sizes),
            "peak_per_module": peak_per_module, "peak_default": peak_default, "bucket": sampler.GATHER_BUCKET_NUMEL,
            "equal_to_whole_gather": sorted(per_module) == sorted(reference) and all(
                torch.equal(per_module[n], reference[n]) and torch.equal(default[n], reference[n]) for n in reference),
            "gathers_for_two_unchanged": gathers_for_two, "shared": shared, "one_snapshot_bytes": one_snapshot,
            "bytes_two_unchanged": bytes_two, "held_after_step": held_after_step, "held_bytes": pool.held_bytes(),
            "max_bytes": pool.max_bytes, "changed_by_step": changed}


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

"""One rank of a real 2-rank ZeRO run (real DeepSpeed engines, real gloo) of ``token_logprobs`` chunked against the
one-pass path, for ``test_logprob_chunks.py``: ``python tests/tinker_server/logprob_chunk_ranks.py OUT_DIR STAGE``
with the launcher environment (RANK, WORLD_SIZE, MASTER_*) set. Rank r writes ``OUT_DIR/rank<r>.json``.

Per case (full fine-tuning; LoRA with ``train_unembed``; both again on a model whose output layer is tied to its
embedding), two engines over the same weights, every parameter
partitioned under ZeRO-3 (persistence threshold 0): one runs the one-pass path, the other the chunked one, on the
same rank-specific batch with ``[B, T, K]`` targets (rank 0 four chunks, rank 1 two: the ranks must still run the
same collectives and walk the same ZeRO-3 module trace); two forward and backward passes each (the second on the
trace DeepSpeed recorded in the first), then the reduced gradients of every trainable parameter
(``safe_get_full_grad``). Under ZeRO-3 the output layer's partitions on this rank are recorded, to show they were
partitioned, not whole.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHUNK = 5
STEPS = 2


def nonzero_lora_b(model):
    """``model`` with LoRA's B matrices random (seeded): PEFT starts them at 0, which zeroes A's gradients."""
    import torch

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def main(out_dir: Path, zero_stage: int) -> None:
    import torch
    import torch.distributed as dist

    from local_ranks.ranks import exit_rank, init_gloo_deepspeed

    init_gloo_deepspeed(timeout_minutes=10)
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from deepspeed_tinker.model import ATTN_IMPLEMENTATION, LoraSpec, add_lora, build_model, token_logprobs
    from deepspeed_tinker.worker import ds_config

    rank = dist.get_rank()
    config = ds_config(zero_stage)
    if zero_stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even the toy model
    generator = torch.Generator().manual_seed(rank)
    length = (3 * CHUNK + 2, CHUNK + 1)[rank % 2]  # ranks with different numbers of chunks; the last one short
    tokens = torch.randint(0, 256, (2, length), generator=generator)
    targets = torch.randint(0, 256, (2, length, 3), generator=generator)
    weights = torch.linspace(0.5, 2.0, targets.numel()).reshape(targets.shape)

    def one_pass(engine, x, y):
        return torch.log_softmax(engine(input_ids=x).logits.float(), dim=-1).gather(-1, y)

    def chunked(engine, x, y):
        return token_logprobs(engine, x, y, chunk_tokens=CHUNK)

    def causal_lm(module: torch.nn.Module) -> torch.nn.Module:
        return module.get_base_model() if hasattr(module, "get_base_model") else module

    def tied(lora: LoraSpec | None) -> torch.nn.Module:
        """The byte model's shape with the output layer tied to the embedding (GPT-2's, small Qwen3s')."""
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            base = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                tie_word_embeddings=True, attn_implementation=ATTN_IMPLEMENTATION))
        return base if lora is None else add_lora(base, lora)

    cases = {"full": lambda: build_model("tiny-llama-byte", None),
             "lora": lambda: build_model("tiny-llama-byte", LoraSpec(rank=4, seed=0, train_unembed=True)),
             "tied-full": lambda: tied(None),  # the one-pass path (model._one_pass_only)
             "tied-lora": lambda: tied(LoraSpec(rank=4, seed=0))}  # the tied output layer frozen: chunked
    report: dict = {"rank": rank}
    for case, build in cases.items():
        report[case] = {}
        for path, function in (("one_pass", one_pass), ("chunked", chunked)):
            module = nonzero_lora_b(build())
            trainable = [p for p in module.parameters() if p.requires_grad]
            engine, *_ = deepspeed.initialize(model=module, model_parameters=trainable, config=config)
            for _ in range(STEPS):  # the second pass runs on DeepSpeed's recorded module trace (prefetching)
                logprobs = function(engine, tokens, targets)
                engine.backward((logprobs * weights).sum())
            named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
            result = {"logprobs": logprobs.detach().tolist(),
                      "grads": {n: safe_get_full_grad(p).tolist() for n, p in named}}
            if zero_stage == 3:
                head = causal_lm(engine.module).get_output_embeddings()
                result["head_partitions"] = {n: [int(p.ds_tensor.numel()), int(p.ds_numel)]
                                             for n, p in head.named_parameters()}
            with torch.no_grad():  # and without grad: no recompute, the same values
                result["no_grad"] = function(engine, tokens, targets).tolist()
            report[case][path] = result
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    exit_rank(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))

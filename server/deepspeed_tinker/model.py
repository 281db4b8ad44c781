"""The models this server trains: built-in byte-level Llamas and local Hugging Face models.

Nothing is downloaded. The built-in models are built from local configs, so the server and a
test's plain PyTorch replay construct bit-identical initial weights from the same name and seed;
their tokens are bytes (token id == byte value). ``serve --base-model PATH`` adds a causal LM saved
with ``save_pretrained`` (any architecture ``AutoModelForCausalLM`` loads), named by its absolute
path, with its tokenizer from the same directory; ``--base-model NAME=PATH`` serves it as NAME.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

#: Seed for the base weights: every rank (and every replay) must start from the same model.
BASE_SEED = 1234
#: Tinker's LoRA defaults: the SDK's ``create_lora_training_client(rank=32)`` and the LoRA primer's "default
#: rank 32"; alpha 32 whatever the rank (scale ``alpha / rank``), tinker-cookbook's ``weights`` README and
#: ``hyperparam_utils.get_lora_lr_over_full_finetune_lr(lora_alpha=32)``, as in "LoRA Without Regret".
DEFAULT_LORA_RANK = 32
LORA_ALPHA = 32
#: Attention through ``torch.nn.functional.scaled_dot_product_attention`` (the best kernel the device has: flash
#: or memory-efficient on GPUs, the flash kernel on CPUs), not ``eager``'s B x heads x T x T probabilities kept for
#: backward. The sampler's scoring forward uses the same, so its logprobs stay the training pass's bit for bit.
ATTN_IMPLEMENTATION = "sdpa"
#: ``--dtype`` values.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class BaseModelSpec:
    """A small Llama-style causal LM, described by the numbers that define it."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_context_length: int
    #: A local model directory (weights, config, tokenizer); None for the built-in byte models.
    path: str | None = None
    #: What generation stops on when the client gives no stop condition (the model's EOS).
    eos_token_ids: tuple[int, ...] = ()
    #: The ``transformers`` architecture family, reported by ``get_info``.
    model_type: str = "llama"


BASE_MODELS: dict[str, BaseModelSpec] = {
    spec.name: spec
    for spec in (
        BaseModelSpec("tiny-llama-byte", 256, 64, 128, 2, 4, 2, 256),
        BaseModelSpec("small-llama-byte", 256, 128, 256, 4, 4, 2, 512),
    )
}


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapters to add; mirrors the SDK's ``LoraConfig``."""

    rank: int
    seed: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def target_modules(self) -> list[str]:
        """Llama module names the adapters wrap."""
        names: list[str] = []
        if self.train_attn:
            names += ["q_proj", "k_proj", "v_proj", "o_proj"]
        if self.train_mlp:
            names += ["gate_proj", "up_proj", "down_proj"]
        if self.train_unembed:
            names.append("lm_head")
        return names


def parse_base_model(value: str) -> tuple[str | None, str]:
    """A ``--base-model`` value: ``PATH`` (served under its absolute path) or ``NAME=PATH`` (served as NAME, e.g.
    the Hugging Face name ``Qwen/Qwen3-8B`` that tinker-cookbook looks renderers and learning rates up by)."""
    if "=" in value and not Path(value).expanduser().is_dir():
        name, path = value.split("=", 1)
        if not name.strip() or not path:
            raise ValueError(f"--base-model {value!r}: expected PATH or NAME=PATH")
        return name.strip(), path
    return None, value


def register_local_model(value: str | os.PathLike[str]) -> BaseModelSpec:
    """Make a local Hugging Face causal LM servable (every rank calls this): ``PATH`` under its absolute path,
    ``NAME=PATH`` under NAME."""
    from transformers import AutoConfig

    name, path = parse_base_model(str(value))
    directory = Path(path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise ValueError(f"--base-model {value}: no config.json in {directory} (save the model with save_pretrained)")
    name = name or str(directory)
    if name in BASE_MODELS and BASE_MODELS[name].path != str(directory):
        raise ValueError(f"--base-model {value}: the name {name!r} is already served from "
                         f"{BASE_MODELS[name].path or 'a built-in config'}")
    config = AutoConfig.from_pretrained(str(directory))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = next((getattr(text, a) for a in ("max_position_embeddings", "n_positions", "max_sequence_length")
                    if getattr(text, a, None)), 2048)
    eos = getattr(text, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos), ))
    spec = BaseModelSpec(name, int(text.vocab_size), int(getattr(text, "hidden_size", 0) or 0), 0,
                         int(getattr(text, "num_hidden_layers", 0) or 0), 0, 0, int(context), path=str(directory),
                         eos_token_ids=eos_ids, model_type=str(config.model_type))
    BASE_MODELS[spec.name] = spec
    return spec


def _lora_targets(model: torch.nn.Module, lora: LoraSpec) -> list[str]:
    """The Llama-style module names the architecture has; for other architectures PEFT's default
    targets for its ``model_type``. The unembedding only when it is not tied to the embedding."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    wanted = [n for n in lora.target_modules() if n in present and n != "lm_head"]
    if not wanted and (lora.train_attn or lora.train_mlp):
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        wanted = list(DEFAULTS.get(model.config.model_type, []))
    tied = getattr(model.config, "tie_word_embeddings", False)
    if lora.train_unembed and "lm_head" in present and not tied:
        wanted.append("lm_head")
    if not wanted:
        raise ValueError(f"no LoRA target modules known for {model.config.model_type} with {lora}")
    return wanted


def build_base(base_model: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The base model alone, in ``dtype``: built-in weights from ``BASE_SEED``, a local model from its directory.

    Under an active ``zero3_construction`` a local model is built and loaded sharded (``deepspeed.zero.Init``);
    a built-in model is built whole (they are toy sizes) and DeepSpeed partitions it later.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = BASE_MODELS[base_model]
    if spec.path is not None:
        return _build_local(spec, dtype)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_context_length,
        tie_word_embeddings=False,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BASE_SEED)
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def add_lora(model: torch.nn.Module, lora: LoraSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Wrap ``model`` (changed in place) with LoRA adapters initialised from ``lora.seed``, scale
    ``LORA_ALPHA / rank`` as Tinker's; only the adapters require grad."""
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.seed)
        adapters = peft.LoraConfig(r=lora.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                   target_modules=_lora_targets(model, lora))
        wrapped = peft.get_peft_model(model, adapters, autocast_adapter_dtype=False)
    for _, param in wrapped.named_parameters():  # the adapters in the base's dtype (the base's own: unchanged)
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return wrapped


def share_frozen(base: torch.nn.Module) -> torch.nn.Module:
    """A new module tree over the SAME parameter and buffer tensors as ``base``: what several LoRA clients
    share (each wraps its own tree with its own adapters; the base weights exist once)."""
    import copy

    memo: dict[int, Any] = {id(t): t for t in (*base.parameters(), *base.buffers())}
    return copy.deepcopy(base, memo)


def build_model(base_model: str, lora: LoraSpec | None, dtype: torch.dtype = torch.float32,
                base: torch.nn.Module | None = None) -> torch.nn.Module:
    """Construct the model: base weights from ``BASE_SEED`` (or the local directory), adapters
    from ``lora.seed``. With ``base`` (a LoRA model only) the frozen weights are ``base``'s own tensors,
    not a copy.

    With ``lora`` set only the adapter weights require grad (PEFT freezes the rest).
    """
    if base is not None and lora is None:
        raise ValueError("full fine-tuning trains the base weights: it cannot share them")
    model = share_frozen(base) if base is not None else build_base(base_model, dtype)
    return model if lora is None else add_lora(model, lora, dtype)


def _build_local(spec: BaseModelSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per model built is noise in a server log
    try:
        return AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    except ValueError:  # an architecture transformers has no SDPA attention for
        return AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, attn_implementation="eager")


@contextlib.contextmanager
def zero3_construction(ds_config: dict[str, Any]) -> Iterator[None]:
    """Build models sharded over the ranks (every rank must enter it together): ``transformers`` sees the
    DeepSpeed ZeRO-3 config, so ``from_pretrained`` constructs under ``deepspeed.zero.Init`` and loads the
    checkpoint one module at a time (rank 0 reads it, each rank keeps its partition). Only inside this
    context: the samplers' plain copies are built whole."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds_config)  # registers itself (a weak reference) while alive
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del keep


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each decoder layer's activations in backward instead of keeping them (non-reentrant
    ``torch.utils.checkpoint``); returns how many layers checkpoint.

    ``transformers`` checkpoints a layer only while it is in training mode. Only the layers themselves are
    put in that mode, not their submodules, so dropout stays off as it is without checkpointing: the server
    trains with the sampler's (dropout-free) forward either way, and the loss and gradients are the same.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    inner.config.use_cache = False
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in inner.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        layer.training = True
    if not layers:
        raise ValueError(f"{type(inner).__name__} has no layers transformers can checkpoint")
    return len(layers)


#: Positions per chunk of the output layer: its fp32 logits (B x chunk x vocabulary) are the largest tensor a pass
#: makes, 1024 x 151,936 x 4 B = 0.6 GB a sequence for Qwen3, instead of T x V (5 GB at 8k tokens).
LOGITS_CHUNK_TOKENS = 1024
#: The architectures (``config.model_type``) whose logits are their output layer's and nothing more, in the installed
#: transformers: the chunked path runs the output layer alone. Others (Gemma 2-4's soft-capping, Granite's and
#: Cohere's scales, ...) take the one-pass path rather than lose what their forward does after it.
CHUNKED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gpt2", "phi3",
                                 "olmo2", "gemma"})


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                   chunk_tokens: int = LOGITS_CHUNK_TOKENS) -> torch.Tensor:
    """``logprobs[b, t] = log p(targets[b, t] | tokens[b, :t+1])`` for a right-padded batch; with
    ``[B, T, K]`` targets (K per position) the result is ``[B, T, K]``.

    Right padding needs no attention mask: a causal model never lets a real position attend
    to a later (padded) one. The model runs without logits (``logits_to_keep`` of no position); the output
    layer then runs on ``chunk_tokens`` positions at a time, in forward and again in backward
    (``_OutputLayerLogprobs``), so the ``B x T x V`` fp32 logits never exist at once. One chunk (``T <=
    chunk_tokens``) is the one-pass computation, bit for bit; more round the output layer's products and its
    gradient's sum in another order (see tests/tinker_server/test_logprob_chunks.py for how far).
    """
    causal = _causal_lm(model)
    head = causal.get_output_embeddings()
    if _one_pass_only(causal, head):
        return _gather_targets(torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1), targets)
    with _gathered(head):  # ZeRO-3: one all-gather of the output layer for the model's forward and all the chunks
        hidden = _final_hidden(model, causal, tokens)
        if not torch.is_grad_enabled() or not (hidden.requires_grad or _trainable(head)):
            return torch.cat([_chunk_logprobs(head, h, t) for h, t in _chunks(chunk_tokens, hidden, targets)], dim=1)
        # With only the output layer training (LoRA on it alone) nothing before it needs a gradient: an empty tensor
        # that does makes autograd call the backward all the same.
        wants_backward = torch.empty(0, device=hidden.device, requires_grad=not hidden.requires_grad)
        return _OutputLayerLogprobs.apply(hidden, targets, head, chunk_tokens, wants_backward)


class _OutputLayerLogprobs(torch.autograd.Function):
    """The output layer's target logprobs a chunk of positions at a time, keeping only ``hidden`` for backward.

    Backward runs each chunk's forward again through the output layer *module* (so PEFT's LoRA on it trains as in
    any forward) and sums its parameters' gradients over the chunks, then accumulates them once (under ZeRO one
    reduction of each, as in the one-pass path). They are not inputs of the node: autograd would fire their
    accumulation hooks (ZeRO's reduction) for a None gradient too, and accumulate a returned one only after ZeRO-3
    has partitioned the parameter again.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, chunk_tokens: int,
                wants_backward: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, targets)
        ctx.head, ctx.chunk_tokens = head, chunk_tokens
        return torch.cat([_chunk_logprobs(head, h, t) for h, t in _chunks(chunk_tokens, hidden, targets)], dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        hidden, targets = ctx.saved_tensors
        params = _trainable(ctx.head)
        sums: list[torch.Tensor | None] = [None] * len(params)
        hidden_grads = []
        with torch.enable_grad(), _gathered(ctx.head):
            for h, t, g in _chunks(ctx.chunk_tokens, hidden, targets, grad):
                h = h.detach().requires_grad_()
                h_grad, *got = torch.autograd.grad(_chunk_logprobs(ctx.head, h, t), [h, *params], g,
                                                   allow_unused=True)
                hidden_grads.append(h_grad)
                sums = [b if a is None else a if b is None else a + b for a, b in zip(sums, got)]
            # Here, while gathered: autograd's accumulation and ZeRO-3's gradient hooks need the whole parameter.
            accumulate = [(p, s) for p, s in zip(params, sums) if s is not None]
            if accumulate:
                torch.autograd.backward([p for p, _ in accumulate], [s for _, s in accumulate])
        hidden_grad = torch.cat(hidden_grads, dim=1) if ctx.needs_input_grad[0] else None
        return hidden_grad, None, None, None, None


@torch.no_grad()
def token_logprobs_topk(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, topk: int,
                        chunk_tokens: int = LOGITS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs`` (the same computation, chunk for chunk: the sampler reports what training computes) and
    each position's ``topk`` largest logprobs with their token ids (``[B, T, topk]``; ``topk`` 0: empty)."""
    causal = _causal_lm(model)
    head = causal.get_output_embeddings()
    if _one_pass_only(causal, head):
        chunks = [(torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1), targets)]
    else:
        chunks = ((_log_softmax(head, h), t) for h, t in _chunks(chunk_tokens, _final_hidden(model, causal, tokens),
                                                                  targets))
    chosen, values, ids = [], [], []
    for logprobs, t in chunks:  # one chunk's logprobs over the vocabulary at a time
        chosen.append(_gather_targets(logprobs, t))
        top = torch.topk(logprobs, topk, dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    return torch.cat(chosen, dim=1), torch.cat(values, dim=1), torch.cat(ids, dim=1)


def _one_pass_only(causal: torch.nn.Module, head: torch.nn.Module) -> bool:
    """Whether the output layer must run on all positions in the model's own forward: the architecture is not one
    known to make its logits with the output layer alone (``CHUNKED_MODEL_TYPES``), or the output layer trains a
    weight tied to the input embedding. That weight's gradient would be accumulated twice in one backward (the
    embedding's, the chunks'), which ZeRO's gradient hooks take for two gradients of one parameter (ZeRO-2 and 3
    assert); one pass sums them first, as autograd does within one graph."""
    if getattr(causal.config, "model_type", None) not in CHUNKED_MODEL_TYPES:
        return True
    embedding = causal.get_input_embeddings()
    tied = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    return any(id(p) in tied for p in _trainable(head))


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside a DeepSpeed engine and/or a PEFT wrapper."""
    model = getattr(model, "module", model)  # a DeepSpeed engine
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _final_hidden(model: torch.nn.Module, causal: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states (after its final norm), from a forward of ``model`` (the engine: its hooks
    run) that makes logits for no position."""
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    hook = causal.get_decoder().register_forward_hook(keep)
    try:
        model(input_ids=tokens, logits_to_keep=torch.empty(0, dtype=torch.long, device=tokens.device))
    finally:
        hook.remove()
    return captured[-1]


def _trainable(head: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The output layer's parameters that take gradients, each once, in module order."""
    return list({id(p): p for p in head.parameters() if p.requires_grad}.values())


def _chunks(chunk_tokens: int, *tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """``tensors`` cut into the same slices of ``chunk_tokens`` positions (dimension 1)."""
    for start in range(0, tensors[0].shape[1], chunk_tokens):
        yield tuple(t[:, start:start + chunk_tokens] for t in tensors)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _gather_targets(_log_softmax(head, hidden), targets)


def _log_softmax(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logprobs over the vocabulary at ``hidden``'s positions."""
    return torch.log_softmax(head(hidden).float(), dim=-1)


def _gather_targets(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if targets.dim() == 3:
        return logprobs.gather(-1, targets)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


#: Marks a ZeRO-3 parameter as held in its set of active modules while ``_gathered`` holds it.
_HELD = -1


@contextlib.contextmanager
def _gathered(module: torch.nn.Module) -> Iterator[None]:
    """Under ZeRO-3, ``module``'s parameters gathered once for the whole block (those not already: those it gathers it
    partitions again at the end) and its tree's forward hooks, DeepSpeed's, set aside meanwhile. The hooks would
    gather and release the parameters at every call of the module, once per chunk; worse, they record each call in
    DeepSpeed's module trace, which every rank must walk alike, and the number of chunks is each rank's own (its
    datums' length): ZeRO-3 fails on the next step ("Detected a disagreement on list length"). Elsewhere nothing."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import collections

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    modules = list(module.modules())
    hooks = [(m._forward_pre_hooks, m._forward_hooks) for m in modules]
    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with deepspeed.zero.GatheredParameters(missing):  # nothing to gather: a no-op
        for m in modules:
            m._forward_pre_hooks, m._forward_hooks = collections.OrderedDict(), collections.OrderedDict()
        for p in params:  # a weight tied to the input embedding: its hooks release only a parameter no module holds
            p.ds_active_sub_modules.add(_HELD)
        try:
            yield
        finally:
            for p in params:
                p.ds_active_sub_modules.discard(_HELD)
            for m, (pre, post) in zip(modules, hooks):
                m._forward_pre_hooks, m._forward_hooks = pre, post


def cross_entropy_sum(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Tinker's ``cross_entropy``: a weighted SUM over tokens, never a mean."""
    return -(logprobs * weights).sum()

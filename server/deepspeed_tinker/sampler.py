"""Sampling on every rank, from snapshots of the training weights, never through the engine.

``save_weights_for_sampler`` copies the trainable weights out of the DeepSpeed engine (gathered
under ZeRO-3, a collective every rank joins) into a CPU snapshot; sampling loads a snapshot into a
plain PyTorch copy of the architecture and generates there. The engine, its gradients and its
ZeRO state are never touched by a sample, so sampling in the middle of an accumulation changes
nothing in that step, and a sampler sees exactly the weights of the last ``optim_step`` before
the snapshot.

Reported logprobs come from one full forward over prompt + completion with the same computation as
the training side's ``token_logprobs`` (``token_logprobs_topk``: the same chunks of the output layer), not
from the incremental decoding pass, so they equal a training ``forward`` on the same tokens up to float
rounding. They are the model's own
logprobs, independent of temperature, top-k and top-p.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .checkpoint_files import read_weights
from .errors import UserError
from .model import BASE_MODELS, LoraSpec, build_base, build_model, token_logprobs_topk
from .sampling import DEFAULT_SNAPSHOT_BYTES, MAX_SNAPSHOTS, SampledSequence, SampleJob, SnapshotRef

#: Beside the weights (``checkpoint_files``) of a named snapshot: its base model and LoRA config.
SAMPLER_META_FILE = "tinker_sampler_meta.json"
#: Under ZeRO-3, modules are gathered together while their parameters add up to at most this many elements (a
#: module larger than it alone): the most a rank holds gathered at once, beside the CPU copies.
GATHER_BUCKET_NUMEL = 1 << 24


def capture_weights(engine: Any, zero_stage: int, trainable_only: bool,
                    bucket_numel: int = GATHER_BUCKET_NUMEL) -> dict[str, torch.Tensor]:
    """CPU copies of the engine's (trainable) parameters, whole even under ZeRO-3.

    Under ZeRO-3 every rank must call this together (each gather is a collective): the parameters are gathered a
    few modules at a time (``bucket_numel`` elements, or one module if larger), copied and released before the next,
    so no rank ever holds the whole model gathered. LoRA adapters, small, take one or a few gathers.
    """
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad or not trainable_only]
    if zero_stage != 3:
        return {n: p.detach().to("cpu", copy=True) for n, p in named}
    import deepspeed

    names = {id(p): n for n, p in named}
    groups: list[list[torch.nn.Parameter]] = [[]]
    taken: set[int] = set()  # a parameter two modules share is gathered once
    size = 0
    for module in engine.module.modules():  # every rank walks the same modules in the same order
        own = [p for p in module.parameters(recurse=False) if id(p) in names and id(p) not in taken]
        if not own:
            continue
        taken.update(id(p) for p in own)
        numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in own)
        if groups[-1] and size + numel > bucket_numel:
            groups.append([])
            size = 0
        groups[-1] += own
        size += numel
    copies: dict[str, torch.Tensor] = {}
    for group in filter(None, groups):
        with deepspeed.zero.GatheredParameters(group, modifier_rank=None):
            for p in group:
                copies[names[id(p)]] = p.detach().to("cpu", copy=True)
    return {n: copies[n] for n, _ in named}


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by several counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _decoder(base_model: str) -> Callable[[list[int]], str]:
    spec = BASE_MODELS[base_model]
    if spec.path is None:
        return lambda ids: bytes(ids).decode("utf-8", errors="replace")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    return lambda ids: tokenizer.decode(ids)


class SamplerPool:
    """This rank's snapshots and the plain modules they are loaded into."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32, max_snapshots: int = MAX_SNAPSHOTS,
                 max_bytes: int = DEFAULT_SNAPSHOT_BYTES) -> None:
        self.device = device
        self.dtype = dtype
        self.max_snapshots = max_snapshots
        self.max_bytes = max_bytes
        #: One plain (unsharded) base model per served model: the base-model sampler itself, and the frozen weights
        #: every LoRA sampler module of that model shares (a full fine-tuning snapshot needs a copy of its own).
        self._bases: dict[str, torch.nn.Module] = {}
        self._snapshots: collections.OrderedDict[str, dict[str, torch.Tensor]] = collections.OrderedDict()
        self._modules: dict[str, torch.nn.Module] = {}
        self._loaded: dict[str, str] = {}  # architecture key -> snapshot id in that module
        self._decoders: dict[str, Callable[[list[int]], str]] = {}

    # ---------------------------------------------------------------- snapshots

    def keep(self, snapshot_id: str, weights: dict[str, torch.Tensor]) -> None:
        """Hold a snapshot; one saved again under the same id (a reused name) replaces the old one. The least
        recently used go while more than ``max_snapshots`` are held or their distinct tensors take more than
        ``max_bytes`` (the newest stays, whatever its size); snapshots of the same weights share their tensors
        (``Worker._save_sampler``), which count once."""
        for key, loaded in self._loaded.items():
            if loaded == snapshot_id:
                self._loaded[key] = ""
        self._snapshots[snapshot_id] = weights
        self._snapshots.move_to_end(snapshot_id)
        while len(self._snapshots) > 1 and (len(self._snapshots) > self.max_snapshots
                                            or self.held_bytes() > self.max_bytes):
            self._snapshots.popitem(last=False)

    def drop(self, snapshot_ids: Iterable[str]) -> None:
        """Let go of these snapshots (those not held any more are skipped)."""
        for snapshot_id in snapshot_ids:
            self._snapshots.pop(snapshot_id, None)
            for key, loaded in self._loaded.items():
                if loaded == snapshot_id:
                    self._loaded[key] = ""

    def held_bytes(self) -> int:
        """Bytes of the snapshots held (each tensor once)."""
        # list(): /metrics reads this from another thread while the rank's jobs change the pool
        return tensor_bytes(t for weights in list(self._snapshots.values()) for t in weights.values())

    def _weights(self, ref: SnapshotRef) -> dict[str, torch.Tensor]:
        if ref.snapshot_id in self._snapshots:
            self._snapshots.move_to_end(ref.snapshot_id)
            return self._snapshots[ref.snapshot_id]
        if ref.file is None:
            if ref.snapshot_id.startswith("base:"):
                return {}
            raise UserError(f"the sampler's weights ({ref.snapshot_id}) are no longer held; this server keeps the "
                            f"last {self.max_snapshots} unnamed snapshots, {self.max_bytes >> 20} MiB at most "
                            "(--sampler-snapshots, --sampler-snapshot-mib; save_weights_for_sampler(name) keeps "
                            "them on disk)")
        try:
            weights = read_weights(Path(ref.file))
        except (OSError, RuntimeError, ValueError) as e:  # deleted, or not a checkpoint this server wrote
            raise UserError(f"cannot read sampler weights {ref.file}: {e}") from None
        self.keep(ref.snapshot_id, weights)
        return weights

    def _module(self, ref: SnapshotRef) -> torch.nn.Module:
        """The architecture with ``ref``'s weights loaded (reloaded only when another snapshot was in it)."""
        pristine = ref.snapshot_id.startswith("base:")
        key = json.dumps([ref.base_model, ref.lora, pristine])
        weights = self._weights(ref)
        module = self._modules.get(key)
        if module is None:
            lora = LoraSpec(**ref.lora) if ref.lora else None
            if pristine or lora is not None:
                base = self._bases.get(ref.base_model)
                if base is None:
                    base = build_base(ref.base_model, self.dtype).to(self.device).eval().requires_grad_(False)
                    self._bases[ref.base_model] = base
                module = base if lora is None else build_model(ref.base_model, lora, self.dtype, base=base)
            else:
                module = build_model(ref.base_model, None, self.dtype)
            module = module.to(self.device).eval().requires_grad_(False)
            self._modules[key] = module
            self._loaded[key] = ""
        if self._loaded[key] != ref.snapshot_id:
            tensors = {**dict(module.named_buffers()), **dict(module.named_parameters())}
            unknown = sorted(set(weights) - set(tensors))
            if unknown:
                raise UserError(f"sampler weights do not fit {ref.base_model}: unknown tensors {unknown[:3]}")
            shared = sorted(n for n in weights if "lora_" not in n) if (pristine or ref.lora) else []
            if shared:  # never write into the base weights other samplers share
                raise UserError(f"LoRA sampler weights for {ref.base_model} hold base tensors {shared[:3]}")
            with torch.no_grad():
                for name, value in weights.items():
                    tensors[name].copy_(value)
            self._loaded[key] = ref.snapshot_id
        return module

    def decoder(self, base_model: str) -> Callable[[list[int]], str]:
        if base_model not in self._decoders:
            self._decoders[base_model] = _decoder(base_model)
        return self._decoders[base_model]

    # ----------------------------------------------------------------- sampling

    def sample(self, job: SampleJob, indices: range, with_prompt: bool) -> dict[str, Any]:
        """Samples ``indices`` of ``job`` (this rank's share), and the prompt logprobs if ``with_prompt``."""
        module = self._module(job.snapshot)
        prompt = torch.tensor(job.prompt, dtype=torch.long, device=self.device)
        part: dict[str, Any] = {"sequences": []}
        if indices:
            completions = generate(module, prompt, job, [job.seeds[i] for i in indices],
                                   self.decoder(job.snapshot.base_model))
            part["sequences"] = score(module, prompt, completions, job.topk_sample_logprobs)
        if with_prompt and job.prompt_logprobs:
            part["prompt"] = prompt_logprobs(module, prompt, job)
        return part

    def sample_many(self, jobs: list[SampleJob], shares: list[range], with_prompt: bool) -> list[tuple[str, Any]]:
        """Several ``asample`` requests at once (concurrent requests, batched): this rank's share of each, as
        ``("ok", part)`` or ``("user", message)`` per job. Requests on the same weights and with the same sampling
        parameters decode as one batch (``generate_batch``: the same tokens as one at a time); each is then scored on
        its own, as ``sample`` does, so its logprobs are computed exactly as before."""
        results: list[tuple[str, Any] | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        for j, job in enumerate(jobs):
            weights = json.dumps([job.snapshot.snapshot_id, job.snapshot.base_model, job.snapshot.lora,
                                  job.snapshot.file], sort_keys=True)
            groups.setdefault((weights, sampling_key(job)), []).append(j)
        for members in groups.values():
            first = jobs[members[0]]
            try:
                module = self._module(first.snapshot)
                prompts = {j: torch.tensor(jobs[j].prompt, dtype=torch.long, device=self.device) for j in members}
                going = [j for j in members if shares[j]]
                completions = generate_batch(module, [(prompts[j], [jobs[j].seeds[i] for i in shares[j]])
                                                      for j in going], first,
                                             self.decoder(first.snapshot.base_model)) if going else []
                done = dict(zip(going, completions))
                for j in members:
                    part: dict[str, Any] = {"sequences": []}
                    if j in done:
                        part["sequences"] = score(module, prompts[j], done[j], jobs[j].topk_sample_logprobs)
                    if with_prompt and jobs[j].prompt_logprobs:
                        part["prompt"] = prompt_logprobs(module, prompts[j], jobs[j])
                    results[j] = ("ok", part)
            except UserError as e:
                for j in members:
                    results[j] = ("user", str(e))
        return results  # type: ignore[return-value]


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the top-k tokens and the smallest nucleus of mass ``top_p``; the rest get -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits


class StopStrings:
    """Whether a completion's text contains a stop string yet, checked as tokens arrive, decoding only the last few.

    Equal to ``any(s in decode(tokens) for s in stops)`` after each token, the check the sampler made by decoding the
    whole completion at every token (``generate_reference``). The text is detokenized incrementally as inference
    servers do it: a window from the previous read offset is decoded, text that ends in an incomplete character
    (U+FFFD) stays pending until the character completes, and only the window's new text is searched, with the
    ``longest - 1`` characters before it (an occurrence that ended earlier was found then).
    """

    def __init__(self, stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> None:
        self.stops = stops
        self.decode = decode
        self.overlap = max(len(s) for s in stops) - 1
        self.tokens: list[int] = []
        self.text = ""  # the text of tokens[:read_offset]
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token: int) -> bool:
        self.tokens.append(token)
        window = self.tokens[self.prefix_offset:]
        prefix = self.decode(window[:self.read_offset - self.prefix_offset])
        pending = self.decode(window)[len(prefix):]
        tail = self.text[len(self.text) - self.overlap:] if self.overlap else ""
        found = any(s in tail + pending for s in self.stops)
        if pending and not pending.endswith("\ufffd"):  # complete: the window's text becomes part of self.text
            self.text += pending
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return found


def _exponential_noise(rows: int, vocab: int, generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """Row ``r`` holds ``vocab`` Exp(1) draws from ``generators[r]``: exactly what ``torch.multinomial(p, 1,
    generator=g)`` draws for a 1-D ``p`` (it samples ``argmax(p / q)`` with ``q ~ Exp(1)``, the exponential race
    form of the Gumbel-max trick), so ``argmax(probs / noise)`` over a batch is each row's multinomial draw."""
    noise = torch.empty(rows, vocab, device=device, dtype=torch.float32)
    for row, generator in enumerate(generators):
        noise[row].exponential_(1, generator=generator)
    return noise


def sampling_key(job: SampleJob) -> tuple:
    """What requests must share to decode in one batch (besides the weights)."""
    return (job.max_tokens, job.temperature, job.top_k, job.top_p, job.stop_tokens, job.stop_strings)


@torch.no_grad()
def generate(module: torch.nn.Module, prompt: torch.Tensor, job: SampleJob, seeds: list[int],
             decode: Callable[[list[int]], str]) -> list[tuple[list[int], str]]:
    """(completion tokens, stop reason) per seed; sample ``i`` depends only on its seed (and the model's numbers).
    One request: ``generate_batch`` of one.

    The tokens are ``generate_reference``'s (the tests compare them on fixed seeds): the draw is the same computation
    from the same generator state. The next-token logits they are drawn from can differ from the reference's in the
    last bits, because a matrix product's rounding depends on how many rows it has (one request's 8 samples or 3
    requests' 20, samples leaving the batch, padding), as the reference's already did between ``num_samples``
    values; a token differs only where two candidates tie to within that rounding (about 1e-7 relative)."""
    return generate_batch(module, [(prompt, seeds)], job, decode)[0]


@torch.no_grad()
def generate_batch(module: torch.nn.Module, requests: list[tuple[torch.Tensor, list[int]]], job: SampleJob,
                   decode: Callable[[list[int]], str]) -> list[list[tuple[list[int], str]]]:
    """Several requests' samples decoded as one batch: ``requests`` are (prompt, seeds) pairs sampled with ``job``'s
    parameters (``sampling_key``); per request, (completion tokens, stop reason) per seed: what ``generate_reference``
    draws for its prompt and seeds (see ``generate`` for how exactly).

    Each distinct prompt is run once (prompts of one length together) and its KV cache repeated per sample; prompts
    of different lengths are left-padded to the longest in the KV cache, and each decode step masks every row's
    padding and runs each row at its own positions. Every
    step draws all samples' tokens in one batched operation (``_exponential_noise``, each sample's noise from its own
    generator); a finished sample leaves the batch (its rows of the KV cache are dropped), so later steps run only
    the samples still going; stop strings are checked incrementally (``StopStrings``). The token that completes a
    stop token or stop string is kept in the completion (reason ``stop``); a completion that reaches ``max_tokens``
    first ends with reason ``length``.
    """
    device = requests[0][0].device
    unique: dict[tuple[int, ...], int] = {}
    for prompt, _ in sorted(requests, key=lambda r: len(r[0])):
        unique.setdefault(tuple(prompt.tolist()), len(unique))
    owner: list[int] = []  # sample -> its prompt's row in the prefill
    seeds: list[int] = []
    for prompt, request_seeds in requests:
        owner += [unique[tuple(prompt.tolist())]] * len(request_seeds)
        seeds += request_seeds
    n = len(seeds)
    generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for prompt in unique:  # in row order: by length, then first seen
        by_length.setdefault(len(prompt), []).append(prompt)
    longest = max(by_length)
    past = cache_name = None
    last: list[torch.Tensor] = []
    for length, prompts in by_length.items():
        out = module(input_ids=torch.tensor(prompts, dtype=torch.long, device=device), use_cache=True)
        # transformers 5 names the KV cache ``cache``; older releases (and some architectures) ``past_key_values``.
        cache_name = "cache" if "cache" in out else "past_key_values"
        last.append(out.logits[:, -1].float())
        if past is None:
            past = out[cache_name]
            layers = [[(layer.keys, layer.values)] for layer in past.layers]
        else:
            for collected, layer in zip(layers, out[cache_name].layers):
                collected.append((layer.keys, layer.values))
    padded = len(by_length) > 1
    if padded:
        for layer, collected in zip(past.layers, layers):  # left-pad each length's keys and values to the longest
            pad = torch.nn.functional.pad
            layer.keys = torch.cat([pad(k, (0, 0, longest - k.shape[-2], 0)) for k, _ in collected])
            layer.values = torch.cat([pad(v, (0, 0, longest - v.shape[-2], 0)) for _, v in collected])
    rows = torch.tensor(owner, device=device)
    logits = torch.cat(last).index_select(0, rows)
    if owner != list(range(len(unique))):
        past.reorder_cache(rows)
    prompt_lengths = torch.tensor([len(p) for p in unique], device=device).index_select(0, rows)
    mask = (torch.arange(longest, device=device)[None, :] >= (longest - prompt_lengths)[:, None]).long()
    completions: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    stop_tokens = set(job.stop_tokens)
    checkers = [StopStrings(job.stop_strings, decode) for _ in range(n)] if job.stop_strings else None
    active = list(range(n))  # batch row -> sample index
    for step in range(job.max_tokens):
        if job.temperature == 0:
            chosen = torch.argmax(logits, dim=-1)
        else:
            probs = torch.softmax(_filter_logits(logits / job.temperature, job.top_k, job.top_p), dim=-1)
            noise = _exponential_noise(len(active), probs.shape[-1], [generators[i] for i in active], probs.device)
            chosen = torch.argmax(probs / noise, dim=-1)
        keep = []
        for row, (i, token) in enumerate(zip(active, chosen.tolist())):
            completions[i].append(token)
            if token in stop_tokens or (checkers is not None and checkers[i].add(token)):
                reasons[i] = "stop"
            else:
                keep.append(row)
        if not keep or step + 1 == job.max_tokens:
            break
        if len(keep) < len(active):
            kept = torch.tensor(keep, device=device)
            past.reorder_cache(kept)
            chosen, mask, prompt_lengths = chosen[kept], mask[kept], prompt_lengths[kept]
            active = [active[row] for row in keep]
        kwargs: dict[str, Any] = {cache_name: past}
        if padded:  # each row at its own position, its padding masked
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            kwargs.update(attention_mask=mask, position_ids=(prompt_lengths + step)[:, None])
        out = module(input_ids=chosen.unsqueeze(1), use_cache=True, **kwargs)
        past, logits = out[cache_name], out.logits[:, -1].float()
    results = [(tokens, reason or "length") for tokens, reason in zip(completions, reasons)]
    split, at = [], 0
    for _, request_seeds in requests:
        split.append(results[at:at + len(request_seeds)])
        at += len(request_seeds)
    return split


@torch.no_grad()
def score(module: torch.nn.Module, prompt: torch.Tensor, completions: list[tuple[list[int], str]],
          topk: int) -> list[SampledSequence]:
    """Each completion's logprobs from one full forward, exactly as training computes them."""
    p = len(prompt)
    length = p + max(len(c) for c, _ in completions) - 1
    tokens = torch.zeros(len(completions), length, dtype=torch.long, device=prompt.device)
    targets = torch.zeros_like(tokens)
    for i, (completion, _) in enumerate(completions):
        full = torch.cat([prompt, torch.tensor(completion, dtype=torch.long, device=prompt.device)])
        tokens[i, :len(full) - 1] = full[:-1]
        targets[i, :len(full) - 1] = full[1:]
    chosen, top_values, top_ids = token_logprobs_topk(module, tokens, targets, topk)
    out = []
    for i, (completion, reason) in enumerate(completions):
        span = slice(p - 1, p - 1 + len(completion))
        ids = values = None
        if topk:
            ids, values = top_ids[i, span].to(torch.int32).cpu().numpy(), top_values[i, span].cpu().numpy()
        out.append(SampledSequence(np.asarray(completion, np.int32), chosen[i, span].cpu().numpy().copy(), reason,
                                   ids, values))
    return out


@torch.no_grad()
def prompt_logprobs(module: torch.nn.Module, prompt: torch.Tensor, job: SampleJob) -> dict[str, np.ndarray]:
    """``[NaN, log p(prompt[1] | prompt[:1]), ...]``; NaN before the last ``prompt_logprobs_last_n``."""
    p = len(prompt)
    values = np.full(p, np.nan, np.float32)
    result: dict[str, np.ndarray] = {}
    if p > 1:
        lp, top_values, top_ids = token_logprobs_topk(module, prompt[:-1].unsqueeze(0), prompt[1:].unsqueeze(0),
                                                      job.topk_prompt_logprobs)
        values[1:] = lp[0].cpu().numpy()
        if job.topk_prompt_logprobs:
            ids = np.zeros((p, job.topk_prompt_logprobs), np.int32)
            vals = np.full((p, job.topk_prompt_logprobs), -99999.0, np.float32)  # the SDK's "nothing here"
            ids[1:], vals[1:] = top_ids[0].cpu().numpy(), top_values[0].cpu().numpy()
            result["topk_ids"], result["topk_logprobs"] = ids, vals
    if job.prompt_logprobs_last_n is not None:
        values[:p - job.prompt_logprobs_last_n] = np.nan
    result["logprobs"] = values
    return result

"""The test oracle of the batched sampler: ``generate_reference``, the sampler as it was before
``deepspeed_tinker.sampler.generate``, which must produce the same tokens on fixed seeds (test_sampler_batching.py).
Not part of the server; ``ds_bench.tinker_sampling`` loads it from here to time the old sampler.
"""

from __future__ import annotations

from typing import Callable

import torch

from deepspeed_tinker.sampler import _filter_logits
from deepspeed_tinker.sampling import SampleJob


@torch.no_grad()
def generate_reference(module: torch.nn.Module, prompt: torch.Tensor, job: SampleJob, seeds: list[int],
             decode: Callable[[list[int]], str]) -> list[tuple[list[int], str]]:
    """The sampler as it was before ``generate``: the oracle ``generate`` must equal (these tests; the sampling
    benchmark times it).

    (completion tokens, stop reason) per seed; sample ``i`` depends only on its seed. Every sample decodes until
    all are done, draws one at a time, and decodes its whole completion at every token for stop strings.

    The token that completes a stop token or stop string is kept in the completion (reason
    ``stop``); a completion that reaches ``max_tokens`` first ends with reason ``length``.
    """
    n = len(seeds)
    generators = [torch.Generator(device=prompt.device).manual_seed(s) for s in seeds]
    out = module(input_ids=prompt.unsqueeze(0).expand(n, -1), use_cache=True)
    # transformers 5 names the KV cache ``cache``; older releases (and some architectures) ``past_key_values``.
    cache_name = "cache" if "cache" in out else "past_key_values"
    past, logits = out[cache_name], out.logits[:, -1].float()
    completions: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    stop_tokens = set(job.stop_tokens)
    for step in range(job.max_tokens):
        if job.temperature == 0:
            chosen = torch.argmax(logits, dim=-1)
        else:
            probs = torch.softmax(_filter_logits(logits / job.temperature, job.top_k, job.top_p), dim=-1)
            chosen = torch.stack([torch.multinomial(probs[i], 1, generator=generators[i])[0] for i in range(n)])
        for i, token in enumerate(chosen.tolist()):
            if reasons[i] is not None:
                continue
            completions[i].append(token)
            if token in stop_tokens or (job.stop_strings and any(s in decode(completions[i])
                                                                 for s in job.stop_strings)):
                reasons[i] = "stop"
        if all(r is not None for r in reasons) or step + 1 == job.max_tokens:
            break
        out = module(input_ids=chosen.unsqueeze(1), use_cache=True, **{cache_name: past})
        past, logits = out[cache_name], out.logits[:, -1].float()
    return [(tokens, reason or "length") for tokens, reason in zip(completions, reasons)]

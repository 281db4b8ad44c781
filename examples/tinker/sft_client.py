"""Supervised fine-tuning through a Tinker-protocol server, written only against the official SDK.

Each step sends a different number of ``forward_backward`` calls (one of them large enough for
the SDK to split into parallel chunks), then one ``optim_step``: the server accumulates every
call's gradient and applies exactly one update. Tokens are bytes, so no tokenizer is needed.

    python examples/tinker/sft_client.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import tinker
from tinker import types

CORPUS = [
    "DeepSpeed trains large models.",
    "The caller owns the boundary.",
    "One step, many backward passes.",
    "Gradients add up until the step.",
    "Unmanaged mode sums, never averages.",
    "Every rank runs its share.",
    "The server keeps requests in order.",
    "Loss is a weighted sum of tokens.",
    "Adam takes exactly one step.",
    "Loopback only, no downloads.",
    "Bytes are the vocabulary.",
    "Small models learn fast.",
]

#: forward_backward calls per optimizer step; the single call of step 1 holds every datum and is
#: chunked by the SDK (the server asks for at most 8 datums per chunk).
CALLS_PER_STEP = [1, 3, 2, 4, 2, 6, 3, 1]


def to_datum(text: str) -> types.Datum:
    """Next-byte prediction on the whole line: input bytes[:-1], targets bytes[1:], weight 1."""
    ids = list(text.encode())
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous, non-empty groups."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", "tml-local-demo"),
                        help="default: $TINKER_API_KEY (the demo sets it to the key its server accepts); a server "
                        "started without keys accepts any key with the SDK's 'tml-' prefix")
    parser.add_argument("--base-model", default="tiny-llama-byte")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank; 0 asks this server for full fine-tuning")
    parser.add_argument("--steps", type=int, default=len(CALLS_PER_STEP))
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    args = parser.parse_args(argv)

    data = [to_datum(text) for text in CORPUS]
    total_weight = sum(len(d.loss_fn_inputs["weights"].data) for d in data)
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=0).result()
    kind = f"LoRA rank {args.rank}" if args.rank else "full fine-tuning"
    print(f"[sft] tinker SDK {tinker.__version__}, model {training.model_id} ({args.base_model}, {kind})", flush=True)

    losses = []
    for step in range(args.steps):
        calls = CALLS_PER_STEP[step % len(CALLS_PER_STEP)]
        start = time.monotonic()
        # Submit everything before waiting: the SDK pipelines, the server keeps seq_id order.
        futures = [training.forward_backward(batch, "cross_entropy") for batch in split(data, calls)]
        optim = training.optim_step(types.AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95,
                                                     eps=1e-8, grad_clip_norm=1.0))
        loss_sum = sum(f.result().metrics["loss:sum"] for f in futures)
        metrics = optim.result().metrics or {}
        losses.append(loss_sum / total_weight)
        print(f"[sft] step {step + 1:2d} | {calls} forward_backward call{'s' if calls > 1 else ' '} "
              f"({int(metrics.get('fwdbwd_requests:sum', 0))} requests after chunking) | "
              f"loss/token {losses[-1]:.4f} | {time.monotonic() - start:.1f} s", flush=True)

    saved = training.save_state("sft-final").result()
    print(f"[sft] saved {saved.path}", flush=True)
    service.close("success").result()
    went_down = losses[-1] < losses[0]
    print(f"[sft] loss/token {losses[0]:.4f} -> {losses[-1]:.4f}: {'down' if went_down else 'NOT down'}", flush=True)
    return 0 if went_down else 1


if __name__ == "__main__":
    sys.exit(main())

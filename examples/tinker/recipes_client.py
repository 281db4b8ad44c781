"""tinker-cookbook's ready-made ``recipes/sl_basic`` against a Tinker-protocol server, unmodified.

The recipe looks its model up by Hugging Face name (renderer, learning rate, tokenizer): the server serves a tiny,
randomly initialised Qwen3 under ``Qwen/Qwen3-8B`` (``--base-model Qwen/Qwen3-8B=<dir>``), and this client
registers that directory's tokenizer under the name, as an offline user's script does. What a user changes on the
recipe's command line is all that changes here: ``base_url``, ``log_path``, the learning rate, the LoRA rank, a few
steps, and the
cookbook's own ``example_data/conversations.jsonl`` in place of the dataset it downloads from the hub.

    python examples/tinker/recipes_client.py --base-url http://127.0.0.1:8000 --model-dir DIR --log-dir DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_API_KEY", "tml-local-demo")

#: The name the recipe resolves (the cookbook's model_info table knows it) and the renderer it picks for it.
MODEL_NAME = "Qwen/Qwen3-8B"


def run_sl_basic(base_url: str, model_dir: Path, log_dir: Path, steps: int, learning_rate: float) -> list[float]:
    """Run ``recipes.sl_basic`` through its own config blueprint and ``main``; return the NLL of each step."""
    import tinker_cookbook
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(MODEL_NAME, lambda: AutoTokenizer.from_pretrained(str(model_dir)))
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL_NAME, renderer_name="qwen3",
                                            max_length=192, batch_size=8,
                                            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    shutil.rmtree(log_dir, ignore_errors=True)
    config = sl_basic.build_config_blueprint(MODEL_NAME).apply({
        "dataset_builder": FromConversationFileBuilder(common_config=common, file_path=str(conversations)),
        "base_url": base_url, "log_path": str(log_dir), "learning_rate": learning_rate, "lora_rank": 8,
        "max_steps": steps, "eval_every": 0, "save_every": 0}).make()
    print(f"[recipes] tinker-cookbook {tinker_cookbook.__version__} recipes/sl_basic on {config.model_name} "
          f"(renderer {config.renderer_name}, LoRA rank {config.lora_rank}), {steps} steps", flush=True)
    sl_basic.main(config)
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-dir", type=Path, required=True, help="the model the server serves as Qwen/Qwen3-8B")
    parser.add_argument("--log-dir", type=Path, required=True, help="the recipe's log_path (emptied first)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-2)
    args = parser.parse_args(argv)

    start = time.monotonic()
    nll = run_sl_basic(args.base_url, args.model_dir, args.log_dir, args.steps, args.learning_rate)
    logging.getLogger().handlers.clear()  # the cookbook's console handler: the summary below says enough
    for step, value in enumerate(nll):
        print(f"[recipes] step {step}: train_mean_nll {value:.3f}", flush=True)
    first, last = sum(nll[:2]) / 2, sum(nll[-2:]) / 2
    fell = len(nll) == args.steps and last < first - 0.5
    print(f"[recipes] loss {first:.3f} -> {last:.3f} (mean of the first and last 2 steps): "
          f"{'fell' if fell else 'did NOT fall'} in {time.monotonic() - start:.0f} s", flush=True)
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())

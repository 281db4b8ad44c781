"""Reinforcement learning through a Tinker-protocol server, driven by tinker-cookbook's RL loop.

The task is a string scored by a Python function: after the prompt ``"letters:"`` the policy
writes 8 bytes and earns the fraction of them that are lowercase ASCII letters. A fresh byte-level
model writes ~26/256 = 0.10 of them by chance; a few dozen policy-gradient steps lift that well
above 0.5. This file only defines the task and the config; the loop is the cookbook's own
``tinker_cookbook.rl.train.main``: per step it snapshots the weights for sampling
(``save_weights_and_get_sampling_client``), samples groups of 8 completions per prompt, computes
group-relative advantages, and sends ``forward_backward(importance_sampling)`` calls — several
per step, their number varying with the data (the SDK splits each into chunks the server asks
for, and constant-reward groups are dropped) — then one ``optim_step``.

    python examples/tinker/rl_client.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the cookbook's progress bars; the reward lines say enough

import chz  # noqa: E402
import tinker  # noqa: E402
from tinker_cookbook import tokenizer_utils  # noqa: E402
from tinker_cookbook.rl import train  # noqa: E402
from tinker_cookbook.rl.types import Action, Env, EnvGroupBuilder, Observation, RLDataset, RLDatasetBuilder, StepResult

from deepspeed_tinker.byte_tokenizer import byte_tokenizer  # noqa: E402 - after the cookbook, as above

BASE_MODEL = "tiny-llama-byte"
PROMPT = b"letters:"
ACTION_TOKENS = 8
GROUPS_PER_BATCH = 4
GROUP_SIZE = 8


def reward(action: Sequence[int]) -> float:
    """The fraction of the written bytes that are lowercase ASCII letters."""
    return sum(ord("a") <= t <= ord("z") for t in action) / ACTION_TOKENS


class LettersEnv(Env):
    """One episode: the prompt, one sampled action of ``ACTION_TOKENS`` bytes, its reward."""

    async def initial_observation(self) -> tuple[Observation, list[int]]:
        return tinker.ModelInput.from_ints(list(PROMPT)), []  # no stop tokens: always 8 bytes

    async def step(self, action: Action, *, extra: object = None) -> StepResult:
        return StepResult(reward=reward(action), episode_done=True, next_observation=tinker.ModelInput.from_ints([]),
                          next_stop_condition=[], metrics={"letters": reward(action)})


class LettersGroup(EnvGroupBuilder):
    """``group_size`` episodes on the same prompt: their mean reward is the advantage baseline."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    async def make_envs(self) -> Sequence[Env]:
        return [LettersEnv() for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["letters"]


class LettersDataset(RLDataset):
    def __init__(self, batches: int, groups_per_batch: int, group_size: int) -> None:
        self.batches, self.groups_per_batch, self.group_size = batches, groups_per_batch, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [LettersGroup(self.group_size) for _ in range(self.groups_per_batch)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class LettersDatasetBuilder(RLDatasetBuilder):
    batches: int = 20
    groups_per_batch: int = GROUPS_PER_BATCH
    group_size: int = GROUP_SIZE

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return LettersDataset(self.batches, self.groups_per_batch, self.group_size), None


def print_rewards(metrics_file: Path, printed: int) -> int:
    """Print the steps logged to the cookbook's ``metrics.jsonl`` since the last call."""
    if not metrics_file.is_file():
        return printed
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "progress/batch" in r]
    for row in rows[printed:]:
        step = f"[rl] step {int(row['step']) + 1:2d} | "
        if "env/all/reward/total" not in row:  # the cookbook drops groups whose samples all scored alike
            print(step + "every group scored alike: nothing to learn, no update", flush=True)
            continue
        print(step + f"reward {row['env/all/reward/total']:.3f} | "
              f"{int(row.get('fwdbwd_requests:sum', 0))} forward_backward requests "
              f"({int(row.get('datums:sum', 0))} datums) | 1 optim_step", flush=True)
    return len(rows)


def quiet_console() -> None:
    """Warnings only on the console (the cookbook installs its own INFO handlers when it starts; its
    whole log, metric tables included, stays in ``<log-dir>/logs.log``)."""
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:
            handler.setLevel(logging.WARNING)
    logging.getLogger("tinker_cookbook.rl.data_processing").setLevel(logging.ERROR)  # "rewards are uniform"


async def run(config: train.Config, metrics_file: Path, verbose: bool) -> None:
    task = asyncio.create_task(train.main(config))
    printed = 0
    while not task.done():
        await asyncio.sleep(0.05 if printed == 0 else 0.5)
        if not verbose:
            quiet_console()
        printed = print_rewards(metrics_file, printed)
    await task
    print_rewards(metrics_file, printed)


def make_config(base_url: str, log_dir: Path, steps: int = 20, learning_rate: float = 2e-2, lora_rank: int = 16,
                minibatches: int = 2) -> train.Config:
    """The cookbook's RL config for the letters task against the server at ``base_url``.

    Registers the byte-level tokenizer with the cookbook's registry (so ``get_tokenizer`` needs no
    download) and empties ``log_dir`` (the cookbook would resume an old run from its checkpoints).
    """
    os.environ.setdefault("TINKER_API_KEY", "tml-local-demo")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer_utils.register_tokenizer(BASE_MODEL, byte_tokenizer)
    if log_dir.exists():
        shutil.rmtree(log_dir)
    return train.Config(
        learning_rate=learning_rate,
        dataset_builder=LettersDatasetBuilder(batches=steps),
        stream_minibatch_config=(train.StreamMinibatchConfig(groups_per_batch=GROUPS_PER_BATCH,
                                                             num_minibatches=minibatches)
                                 if minibatches > 1 else None),
        model_name=BASE_MODEL,
        recipe_name="tinker-server-letters",
        max_tokens=ACTION_TOKENS,
        log_path=str(log_dir),
        base_url=base_url,
        lora_rank=lora_rank,
        loss_fn="importance_sampling",
        remove_constant_reward_groups=True,
        eval_every=0,
        save_every=0,
        num_groups_to_log=0,
        rollout_json_export=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--log-dir", type=Path, required=True, help="the cookbook's log_path (emptied first)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=2e-2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--minibatches", type=int, default=2,
                        help="forward_backward calls per optimizer step (the cookbook's streaming minibatches)")
    parser.add_argument("--verbose", action="store_true", help="keep the cookbook's own console log")
    args = parser.parse_args(argv)

    config = make_config(args.base_url, args.log_dir, args.steps, args.learning_rate, args.lora_rank, args.minibatches)
    start = time.monotonic()
    print(f"[rl] tinker {tinker.__version__}, tinker-cookbook RL loop on {BASE_MODEL} (LoRA rank {args.lora_rank}): "
          f"reward = fraction of lowercase letters in {ACTION_TOKENS} sampled bytes", flush=True)
    asyncio.run(run(config, args.log_dir / "metrics.jsonl", args.verbose))
    rows = [json.loads(line) for line in (args.log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    rose = last > first + 0.1
    print(f"[rl] reward {first:.3f} -> {last:.3f} (mean of the first and last 3 steps): "
          f"{'rose' if rose else 'did NOT rise'} in {time.monotonic() - start:.0f} s", flush=True)
    return 0 if rose else 1


if __name__ == "__main__":
    sys.exit(main())

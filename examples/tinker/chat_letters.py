"""The RL demo's letters task as a chat, for tinker-cookbook entry points run on a Hugging Face name.

The cookbook's ``recipes/rl_basic`` trains on GSM8K from the hub (unreachable offline) and a tiny random model
would never solve it, so its tests and demos swap in this dataset builder (``dataset_builder=...``, as the
recipe's own comments suggest for SL): the user asks for letters through the model's renderer (``qwen3``,
``role_colon``, …), the policy answers with up to ``max_tokens`` tokens, and the reward is the fraction of
``max_tokens`` that are tokens decoding to one lowercase ASCII letter (special tokens count as none, however their
names are spelled). Everything else is the recipe's.
"""

from __future__ import annotations

from collections.abc import Sequence

import chz
import tinker
from tinker_cookbook import renderers, tokenizer_utils
from tinker_cookbook.rl.types import Action, Env, EnvGroupBuilder, Observation, RLDataset, RLDatasetBuilder, StepResult

QUESTION = "Write lowercase letters."


def reward(tokenizer: tokenizer_utils.Tokenizer, action: Sequence[int], max_tokens: int) -> float:
    """The fraction of ``max_tokens`` that the answer's tokens each spelling one lowercase ASCII letter make."""
    letters = sum(len(text) == 1 and "a" <= text <= "z" for text in (tokenizer.decode([t]) for t in action))
    return min(letters, max_tokens) / max_tokens


class ChatLettersEnv(Env):
    """One turn: the rendered question, one sampled answer, its reward."""

    def __init__(self, renderer: renderers.Renderer, max_tokens: int) -> None:
        self.renderer, self.max_tokens = renderer, max_tokens

    async def initial_observation(self) -> tuple[Observation, list[int] | list[str]]:
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": QUESTION}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: object = None) -> StepResult:
        value = reward(self.renderer.tokenizer, action, self.max_tokens)
        return StepResult(reward=value, episode_done=True, next_observation=tinker.ModelInput.from_ints([]),
                          next_stop_condition=self.renderer.get_stop_sequences(), metrics={"letters": value})


class ChatLettersGroup(EnvGroupBuilder):
    def __init__(self, renderer: renderers.Renderer, group_size: int, max_tokens: int) -> None:
        self.renderer, self.group_size, self.max_tokens = renderer, group_size, max_tokens

    async def make_envs(self) -> Sequence[Env]:
        return [ChatLettersEnv(self.renderer, self.max_tokens) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["letters"]


class ChatLettersDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, batches: int, batch_size: int, group_size: int,
                 max_tokens: int) -> None:
        self.renderer, self.batches, self.batch_size = renderer, batches, batch_size
        self.group_size, self.max_tokens = group_size, max_tokens

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [ChatLettersGroup(self.renderer, self.group_size, self.max_tokens) for _ in range(self.batch_size)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class ChatLettersDatasetBuilder(RLDatasetBuilder):
    """Like the cookbook's ``Gsm8kDatasetBuilder``: a renderer and tokenizer by name, batches of groups."""

    renderer_name: str
    model_name_for_tokenizer: str
    batch_size: int = 4
    group_size: int = 8
    batches: int = 20
    max_tokens: int = 8

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        tokenizer = tokenizer_utils.get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer)
        return ChatLettersDataset(renderer, self.batches, self.batch_size, self.group_size, self.max_tokens), None

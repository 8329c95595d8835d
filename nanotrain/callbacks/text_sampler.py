"""TextSampler: generate short continuations of fixed prompts while training."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer


class TextSampler(Callback):
    """Every `every_n_steps` steps, continues each prompt and logs the text.

    Contract with the module: it has
    `generate(input_ids: LongTensor [1, T], max_new_tokens: int, temperature: float = 0.0,
    generator: torch.Generator | None = None) -> LongTensor [1, T + n]`
    (as `LanguageModelModule` does). The tokenizer (`encode(str) -> list[int]`,
    `decode(list[int]) -> str`) is the `tokenizer` argument or `trainer.datamodule.tokenizer`.

    Generation runs on every rank (a sharded model's forward is collective); the sampling
    generator is seeded with `seed + trainer.global_step` on the device, so every rank draws
    the same tokens and a rerun draws them again. Rank 0 writes each sample, at the step's
    `trainer.logged_step` (Lightning's 0-based step, where its `train/loss` is logged too):
        - to `<run_dir>/samples.jsonl`: {"step", "prompt", "completion", "temperature"};
        - to the loggers as text `samples/<i>` (TensorBoard's text tab, and a "text" entry
          in metrics.jsonl), as "prompt ‖ completion".

    Args:
        prompts: the texts to continue (at least one).
        every_n_steps: sampling cadence in optimizer steps.
        max_new_tokens: tokens generated per prompt.
        temperature: 0 for greedy decoding, > 0 to sample.
        tokenizer: overrides the datamodule's tokenizer.
        seed: base seed of the sampling generator.

    Raises:
        ValueError: for no prompts, a non-positive cadence or length, a negative temperature,
            or (at fit start) when no tokenizer can be found or the strategy's layout cannot
            generate (`Strategy.generation_refusal`: pp > 1 or cp > 1).
        TypeError: (at fit start) when the module has no `generate`.
    """

    def __init__(
        self,
        prompts: list[str],
        every_n_steps: int = 500,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        tokenizer: Any = None,
        seed: int = 0,
    ) -> None:
        if isinstance(prompts, str) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings, e.g. ['Once upon a']")
        if every_n_steps <= 0 or max_new_tokens <= 0:
            raise ValueError(
                f"every_n_steps and max_new_tokens must be positive, got {every_n_steps} and "
                f"{max_new_tokens}"
            )
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        self.prompts = list(prompts)
        self.every_n_steps = every_n_steps
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.tokenizer = tokenizer
        self.seed = seed
        self._tokenizer: Any = None

    def on_fit_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Find the tokenizer and check the module can generate, before any step runs."""
        if not callable(getattr(module, "generate", None)):
            raise TypeError(
                f"TextSampler needs {type(module).__name__}.generate(input_ids, max_new_tokens, "
                "temperature, generator); implement it or remove the TextSampler callback"
            )
        refusal = trainer.strategy.generation_refusal()
        if refusal is not None:
            raise ValueError(
                f"TextSampler cannot sample under {type(trainer.strategy).__name__}: {refusal}; "
                "remove the TextSampler callback, or export the checkpoint and sample with a "
                "single-device strategy"
            )
        tokenizer = self.tokenizer or getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                "TextSampler found no tokenizer: pass TextSampler(tokenizer=...) or give the "
                "datamodule a `tokenizer` attribute with encode() and decode()"
            )
        self._tokenizer = tokenizer

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        """Sample on the steps that are multiples of `every_n_steps`."""
        step = trainer.global_step
        if step % self.every_n_steps == 0:
            records = self.sample(module, trainer.strategy.root_device, step)
            self.write(trainer, trainer.logged_step, records)

    def sample(self, module: NanoModule, device: torch.device, step: int) -> list[dict[str, Any]]:
        """Continue every prompt with the generator seeded `seed + step` (`step`: the
        `trainer.global_step` that counts the step just taken); returns [{"step", "prompt",
        "completion", "temperature"}] with "step" the step it is logged at, step - 1
        (Lightning's 0-based convention)."""
        records = []
        generator = torch.Generator(device=device).manual_seed(self.seed + step)
        for prompt in self.prompts:
            ids = self._tokenizer.encode(prompt)
            input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
            out = module.generate(
                input_ids, self.max_new_tokens, temperature=self.temperature, generator=generator
            )  # [1, T + n]
            completion = self._tokenizer.decode(out[0, len(ids) :].tolist())
            records.append(
                {
                    "step": step - 1,
                    "prompt": prompt,
                    "completion": completion,
                    "temperature": self.temperature,
                }
            )
        return records

    def write(self, trainer: Trainer, step: int, records: list[dict[str, Any]]) -> None:
        """Rank 0: append `records` to samples.jsonl and send them to the loggers as text."""
        if not trainer.is_global_zero:
            return
        if trainer.run_dir is not None:
            with (trainer.run_dir / "samples.jsonl").open("a", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
        for i, record in enumerate(records):
            trainer.loggers.log_text(
                f"samples/{i}", f"{record['prompt']} ‖ {record['completion']}", step
            )

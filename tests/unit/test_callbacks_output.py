"""ProgressBar and TextSampler: what they write, and where."""

from __future__ import annotations

import functools
import io
import json
import re
from types import SimpleNamespace

import pytest
import torch

import nanotrain as nt
from nanotrain import testing as toy
from nanotrain.callbacks.progress import ProgressBar
from nanotrain.callbacks.text_sampler import TextSampler
from nanotrain.testing import BlobsData, Classifier

# progress lines are checked at every second step
make_trainer = functools.partial(toy.make_trainer, log_every_n_steps=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class HalfSecondSteps(nt.Callback):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        self.clock.now += 0.5


class Tokens(Classifier):
    def count_tokens(self, batch):
        return 10 * len(batch[0])


# -- progress bar ----------------------------------------------------------------------------
def test_plain_lines_show_step_loss_lr_rate_and_eta(tmp_path):
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressBar(stream=stream, clock=clock)  # "auto" + a non-terminal stream = plain lines
    trainer = make_trainer(tmp_path, callbacks=[HalfSecondSteps(clock), bar])
    trainer.fit(Tokens(lr=0.05), BlobsData())
    lines = stream.getvalue().splitlines()
    records = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    # by step number: the step's records are logged at Lightning's 0-based step
    loss = {r["step"] + 1: r["train/loss"] for r in records if "train/loss" in r}
    # 80 tokens per 0.5 s step = 160 tok/s; at step 2, two steps of 0.5 s are left
    assert (
        lines[0]
        == f"step 2/4 (50%) | loss {loss[2]:.4f} | lr 5.00e-02 | 160 tok/s | 0.500 s/step | ETA 0:00:01"
    )
    assert lines[1].startswith(f"step 4/4 (100%) | loss {loss[4]:.4f} |")
    assert lines[2].startswith("validation at step 4")
    assert lines[3] == "done: 4 steps in 0:00:02"


class SlowFirstStep(nt.Callback):
    """Step 1 takes 10 s (a compile, say), every later step 0.5 s."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        self.clock.now += 10.0 if trainer.global_step == 0 else 0.5


def test_rate_and_eta_come_from_the_steps_since_the_previous_line(tmp_path):
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressBar(stream=stream, clock=clock)
    trainer = make_trainer(tmp_path, callbacks=[SlowFirstStep(clock), bar], max_steps=6)
    trainer.fit(Tokens(lr=0.05), BlobsData())
    rates = [line.split(" | ")[-3:] for line in stream.getvalue().splitlines()[:3]]
    # step 1 took 10 s and is left out; step 2 took 0.5 s, steps 3-4 and 5-6 1 s each
    # (80 tokens per step); at step 2, four steps of 0.5 s are left
    assert rates[0] == ["160 tok/s", "0.500 s/step", "ETA 0:00:02"]
    assert rates[1] == ["160 tok/s", "0.500 s/step", "ETA 0:00:01"]
    assert rates[2] == ["160 tok/s", "0.500 s/step", "ETA 0:00:00"]


def test_bar_is_silent_on_other_ranks_and_plain_off_a_terminal():
    assert ProgressBar()._resolve_mode(SimpleNamespace(is_global_zero=False)) == "off"
    assert (
        ProgressBar(stream=io.StringIO())._resolve_mode(SimpleNamespace(is_global_zero=True))
        == "plain"
    )


def test_rich_bar_runs_to_the_last_step(tmp_path):
    stream = io.StringIO()
    trainer = make_trainer(tmp_path, callbacks=[ProgressBar(mode="rich", stream=stream)])
    trainer.fit(Classifier(), BlobsData())
    assert "4/4" in stream.getvalue()


class StepInValidation(Classifier):
    """Shows the step each validation ran after in the bar (val/after_step)."""

    def validation_step(self, batch, batch_idx):
        step = float(self._nano_trainer.global_step)
        self.log("val/after_step", step, prog_bar=True, batch_size=len(batch[0]))
        return super().validation_step(batch, batch_idx)


def test_rich_bar_last_frame_shows_the_final_validation(tmp_path):
    # validation after the last step comes after the bar's last step update: its values
    # still reach the bar, so the last frame does not show the previous validation's
    stream = io.StringIO()
    bar = ProgressBar(mode="rich", stream=stream)
    trainer = make_trainer(tmp_path, callbacks=[bar], val_check_interval=2, max_steps=5)
    trainer.fit(StepInValidation(), BlobsData())
    shown = re.findall(r"val/after_step (\d+\.\d+)", stream.getvalue())
    assert shown and shown[-1] == "5.0000", shown  # validations after steps 2, 4 and 5
    assert bar.last_validation_step == 5


def test_progress_bar_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        ProgressBar(mode="tqdm")


# -- text sampler ----------------------------------------------------------------------------
class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class Counter(Classifier):
    """`generate` continues with the next character codes: "ab" → "abcde"; records its calls."""

    calls: list

    def generate(self, input_ids, max_new_tokens, temperature=0.0, generator=None):
        self.calls = getattr(self, "calls", []) + [(temperature, generator.initial_seed())]
        last = int(input_ids[0, -1])
        new = torch.arange(last + 1, last + 1 + max_new_tokens).unsqueeze(0)  # [1, n]
        return torch.cat([input_ids, new], dim=1)


def test_samples_are_written_to_samples_jsonl_and_the_loggers(tmp_path):
    sampler = TextSampler(
        ["ab", "x"],
        every_n_steps=2,
        max_new_tokens=3,
        temperature=0.7,
        tokenizer=CharTokenizer(),
        seed=10,
    )
    trainer = make_trainer(tmp_path, callbacks=[sampler])
    module = Counter()
    trainer.fit(module, BlobsData())
    samples = [json.loads(x) for x in (trainer.run_dir / "samples.jsonl").read_text().splitlines()]
    # at steps 2 and 4, written at their logged (Lightning's 0-based) steps 1 and 3
    assert samples == [
        {"step": 1, "prompt": "ab", "completion": "cde", "temperature": 0.7},
        {"step": 1, "prompt": "x", "completion": "yz{", "temperature": 0.7},
        {"step": 3, "prompt": "ab", "completion": "cde", "temperature": 0.7},
        {"step": 3, "prompt": "x", "completion": "yz{", "temperature": 0.7},
    ]
    # one generator per sampling round, seeded with seed + global_step
    assert module.calls == [(0.7, 12), (0.7, 12), (0.7, 14), (0.7, 14)]
    records = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    texts = [(r["step"], r["text"]) for r in records if "text" in r]
    assert (3, {"samples/1": "x ‖ yz{"}) in texts
    assert any(r["step"] == 3 and "train/loss" in r for r in records)  # that step's loss


def test_sampler_without_tokenizer_or_generate_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        make_trainer(tmp_path, callbacks=[TextSampler(["a"])]).fit(Counter(), BlobsData())
    with pytest.raises(TypeError, match="generate"):
        sampler = TextSampler(["a"], tokenizer=CharTokenizer())
        make_trainer(tmp_path, callbacks=[sampler]).fit(Classifier(), BlobsData())


@pytest.mark.parametrize("layout", [dict(cp=2), dict(pp=2)])
def test_sampler_refuses_layouts_that_cannot_generate_at_fit_start(layout):
    # the strategy is only asked (no world is formed): cp > 1 and pp > 1 cannot run generate
    strategy = nt.MegatronStrategy(**layout)
    trainer = SimpleNamespace(strategy=strategy, datamodule=None)
    sampler = TextSampler(["a"], tokenizer=CharTokenizer())
    name = "context" if "cp" in layout else "pipeline"
    with pytest.raises(
        ValueError, match=f"TextSampler cannot sample under MegatronStrategy: {name}"
    ):
        sampler.on_fit_start(trainer, Counter())
    # one process and plain Megatron layouts can
    assert nt.SingleDeviceStrategy("cpu").generation_refusal() is None
    assert nt.MegatronStrategy(tp=2).generation_refusal() is None

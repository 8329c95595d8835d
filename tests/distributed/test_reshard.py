"""Resuming a MegatronStrategy checkpoint under another layout and world size.

One forked gloo world of 4 ranks saves the tiny DeepSeek (MLA, MoE with a bias-balanced
router, MTP, odd vocabulary padded under tp) after 2 steps under tp=2 x pp=2 (DualPipeV,
its two chunks per rank in a V) and under
ep=2 x dp=2 with ZeRO-2, then resumes the first under pp=2 x dp=2 (1F1B with split backwards)
and the second under tp=2 x ep=2; the test process resumes both on one process. Steps 3 and 4 must match the uninterrupted run (fp32, relative
1e-5; the one-process run, which every saving layout equals: test_pipeline, test_expert_parallel):
step 3 needs the weights and the data position (global samples consumed) to carry over,
step 4 Adam's moments and step and the LR schedule. A one-process checkpoint is
resumed under tp=2 x pp=2 DualPipeV the same way. A second world of 8 ranks checks
that a same-layout resume under tp x pp x dp with ZeRO-2 stays bitwise exact (from an
asynchronous save).
"""

from __future__ import annotations

import pytest

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from tests.distributed.spawn import run_world
from tests.unit.test_language_model import RandomTokens

pytestmark = pytest.mark.distributed

# tp=2 x pp=2 saves from DualPipeV's V: rank 0 holds layer 0, the head and MTP, rank 1
# layer 1 (stages 1 and 3 hold no layer)
SAVED = {
    "tp2 pp2 dualpipev": dict(tp=2, pp=2, schedule="dualpipev", pipeline_layout=[1, 0, 1, 0]),
    "ep2 dp2 zero2": dict(ep=2, zero_stage=2),
}
# saved layout -> the layout that resumes it. pp=2 x dp=2 resumes with split backwards: a
# checkpoint does not depend on the schedule. One pairing per saved layout: loading goes
# through whole tensors by name (`nanotrain.checkpoint.reshard`: the saved shards are put
# together, then the resuming rank takes its slice), so what a saving layout writes and what
# a resuming layout reads are independent, and each is proven by one pairing here and by the
# one-process save and resumes below
RESUMED = {
    "tp2 pp2 dualpipev": ("pp2 dp2 zb_1f1b", dict(pp=2, schedule="zb_1f1b")),
    "ep2 dp2 zero2": ("tp2 ep2", dict(tp=2, ep=2)),
}


class StepLosses(nt.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(outputs.loss)


def fit(
    root: str, strategy, max_steps: int, ckpt_path=None, save=False, async_save=False
) -> dict[int, float]:
    recorder = StepLosses()
    saver = ModelCheckpoint(every_n_steps=2, async_save=async_save)
    callbacks = [recorder] + ([saver] if save else [])
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=max_steps,
        global_batch_size=4,
        micro_batch_size=1,
        default_root_dir=root,
        loggers=[],
        seed=3,
        callbacks=callbacks,
    )
    module = nt.LanguageModelModule(
        model="tiny", vocab_size=257, lr=1e-2, warmup_steps=1, decay_steps=8
    )
    trainer.fit(module, train_dataloaders=RandomTokens(32, 257), ckpt_path=ckpt_path)
    return recorder.losses


def ckpt_of(root: str, name: str) -> str:
    return f"{root}/{name}/split/default/version_0/checkpoints/step-00000002"


# saved at step 2, resumed for steps 3 and 4 (see the module docstring)
RESUMED_STEPS = 4


def _reshard_world(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    for name, layout in SAVED.items():
        fit(f"{root}/{name}/split", nt.MegatronStrategy(**layout), 2, save=True)
        other, target = RESUMED[name]
        out[name] = {
            other: fit(
                f"{root}/{other}",
                nt.MegatronStrategy(**target),
                RESUMED_STEPS,
                ckpt_path=ckpt_of(root, name),
            )
        }
    # the test process saved this one on one process (whole model, index-keyed optimizer);
    # it resumes into DualPipeV's V
    strategy = nt.MegatronStrategy(**SAVED["tp2 pp2 dualpipev"])
    out["one process"] = fit(
        f"{root}/from-one", strategy, RESUMED_STEPS, ckpt_path=ckpt_of(root, "one")
    )
    return out


def test_checkpoints_resume_under_other_layouts_and_on_one_process(tmp_path):
    root = str(tmp_path)
    one = nt.SingleDeviceStrategy("cpu")
    straight = fit(f"{root}/one/straight", one, RESUMED_STEPS)
    fit(f"{root}/one/split", nt.SingleDeviceStrategy("cpu"), 2, save=True)
    results = run_world(_reshard_world, 4, root, timeout=600)
    # saved on one process, resumed under tp=2 x pp=2 DualPipeV
    runs = {("one process", "tp2 pp2 dualpipev"): results[0]["one process"]}
    for name in SAVED:
        other = RESUMED[name][0]
        runs[name, other] = results[0][name][other]
        with pytest.warns(UserWarning, match="is resharded for SingleDeviceStrategy"):
            runs[name, "one process"] = fit(
                f"{root}/single-{name}",
                nt.SingleDeviceStrategy("cpu"),
                RESUMED_STEPS,
                ckpt_of(root, name),
            )
    for (name, other), losses in runs.items():
        assert sorted(losses) == [3, 4], (name, other)
        for step in (3, 4):
            assert losses[step] == pytest.approx(straight[step], rel=1e-5, abs=0), (
                f"saved under {name}, resumed under {other}: loss of step {step}"
            )


def _same_layout_world(rank: int, world_size: int, root: str) -> dict:
    layout = dict(tp=2, pp=2, zero_stage=2)  # dp=2
    straight = fit(f"{root}/straight", nt.MegatronStrategy(**layout), 4)
    # saved asynchronously: ZeRO's state is exported and copied before the loop goes on
    fit(f"{root}/split", nt.MegatronStrategy(**layout), 2, save=True, async_save=True)
    resumed = fit(f"{root}/split", nt.MegatronStrategy(**layout), 4, ckpt_path="last")
    return {"straight": straight, "resumed": resumed}


def test_same_layout_resume_stays_bitwise_under_tp_pp_dp_zero2(tmp_path):
    for result in run_world(_same_layout_world, 8, str(tmp_path), timeout=600):
        assert sorted(result["resumed"]) == [3, 4]
        for step in (3, 4):
            assert result["resumed"][step] == result["straight"][step], step

"""`nanotrain fit` with DualPipeV on two ranks equals the same command on one process.

The README's tiny DeepSeek config (MLA, MoE with a shared expert and aux-loss-free balancing,
an MTP module) through the command's own entry point: once on one process, once on a forked
2-rank gloo world with the variables torchrun sets (torchrun itself is exercised by
tests/integration/test_torchrun_restart.py), as `--strategy megatron --strategy.pp 2
--strategy.schedule dualpipev --strategy.overlap_forward_backward true` with an uneven
`pipeline_layout` (two of the four virtual stages hold no layer). Every logged step's loss
terms, grad norm and router biases, and the validation loss, must match (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.spawn import run_world
from tests.integration.test_cli_errors import _command_on_rank

pytestmark = pytest.mark.distributed

#: per step: the loss terms, the grad norm and the router biases the balancing moved
KEYS = ("train/loss", "train/lm_loss", "train/mtp_loss", "train/aux_loss", "train/grad_norm",
        "moe/layer1/bias_abs_max", "moe/layer2/bias_abs_max")  # fmt: skip


def _argv(root: Path, *strategy: str) -> list[str]:
    return [
        "fit", "--config", "examples/configs/tiny_deepseek.yaml", *strategy,
        "--trainer.max_steps", "2", "--trainer.global_batch_size", "8",
        "--trainer.micro_batch_size", "2", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
        "--trainer.validate_at_start", "false", "--trainer.loggers", "[jsonl]",
        "--data.init_args.seq_len", "32", "--trainer.default_root_dir", str(root),
    ]  # fmt: skip


def _by_step(root: Path) -> dict[int, dict]:
    """The jsonl logger's records merged per step."""
    path = next(root.glob("*/version_0/metrics.jsonl"))
    steps: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps


def test_dualpipev_under_the_cli_matches_one_process(tmp_path):
    env = {"NANOTRAIN_CACHE": str(tmp_path / "cache")}
    one = tmp_path / "one"
    [(code, err)] = run_world(_command_on_rank, 1, _argv(one, "--strategy", "single"), env)
    assert code == 0, err
    piped = tmp_path / "pp2"
    strategy = ["--strategy", "megatron", "--strategy.pp", "2",
                "--strategy.schedule", "dualpipev", "--strategy.overlap_forward_backward", "true",
                "--strategy.pipeline_layout", "[1, 0, 1, 0]"]  # fmt: skip
    ranks = run_world(_command_on_rank, 2, _argv(piped, *strategy), env, timeout=240)
    assert [code for code, _ in ranks] == [0, 0], ranks
    report = next(piped.glob("*/version_0/report.md")).read_text()
    assert "pp=2" in report and "schedule=dualpipev" in report
    expected, got = _by_step(one), _by_step(piped)
    assert sorted(got) == sorted(expected) == [0, 1]
    for step, want in expected.items():
        for key in (*KEYS, "val/loss") if "val/loss" in want else KEYS:
            assert got[step][key] == pytest.approx(want[key], rel=1e-5), (step, key)
    assert "val/loss" in expected[1]

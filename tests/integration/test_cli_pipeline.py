"""`nanotrain fit` with DualPipeV on two ranks equals the same command on one process.

The README's tiny DeepSeek config (MLA, MoE with a shared expert and aux-loss-free balancing,
an MTP module) through the command's own entry point: once on one process, once on a forked
2-rank gloo world with the variables torchrun sets (torchrun itself is exercised by
tests/integration/test_torchrun_restart.py), as `--strategy megatron --strategy.pp 2
--strategy.schedule dualpipev --strategy.overlap_forward_backward true` with an uneven
`pipeline_layout` (two of the four virtual stages hold no layer). The data are the demo
corpus's windows as right-padded sequences of different lengths (`RaggedTokens`: ignored
labels, so microbatches and ranks count different numbers of tokens). Every logged step's loss
terms, grad norm and router biases, and the validation loss, must match (fp32). On a 4-rank
world the same for pp=4 (1F1B: embedding, one layer, one layer, head and MTP), pp=2 x ep=2 (DualPipeV, node-limited
dispatch on nodes of one rank) and pp=2 x tp=2 with sequence parallelism (DualPipeV).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from nanotrain.data import TokenDataModule
from tests.distributed.spawn import run_world
from tests.integration.test_cli_errors import _command_on_rank

pytestmark = pytest.mark.distributed

#: per step: the loss terms, the grad norm, the router biases the balancing moved and the
#: tokens counted so far (labels that are not ignored)
KEYS = ("train/loss", "train/lm_loss", "train/mtp_loss", "train/aux_loss", "train/grad_norm",
        "moe/layer1/bias_abs_max", "moe/layer2/bias_abs_max", "trainer/consumed_tokens")  # fmt: skip


class _Ragged(Dataset):
    """Window i of `windows` keeps its first 4 + (5 i mod 29) labels; the rest are -100."""

    def __init__(self, windows: Dataset) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = dict(self.windows[i])
        labels = item["labels"].clone()
        labels[4 + (5 * i) % 29 :] = -100
        item["labels"] = labels
        return item


class RaggedTokens(TokenDataModule):
    """`TokenDataModule`'s windows as right-padded sequences of different lengths (`_Ragged`)."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        for name in ("train_dataset", "val_dataset"):
            windows = getattr(self, name)
            if windows is not None and not isinstance(windows, _Ragged):
                setattr(self, name, _Ragged(windows))


def _argv(root: Path, *strategy: str) -> list[str]:
    return [
        "fit", "--config", "examples/configs/tiny_deepseek.yaml", *strategy,
        "--data.class_path", "tests.integration.test_cli_pipeline.RaggedTokens",
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


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    """The one-process command's run folder (shared by both tests)."""
    root = tmp_path_factory.mktemp("one")
    env = {"NANOTRAIN_CACHE": str(root / "cache")}
    [(code, err)] = run_world(_command_on_rank, 1, _argv(root, "--strategy", "single"), env)
    assert code == 0, err
    return root


def _assert_same_records(one: Path, other: Path) -> None:
    expected, got = _by_step(one), _by_step(other)
    assert sorted(got) == sorted(expected) == [0, 1]
    for step, want in expected.items():
        for key in (*KEYS, "val/loss") if "val/loss" in want else KEYS:
            assert got[step][key] == pytest.approx(want[key], rel=1e-5), (step, key, other.name)
    assert "val/loss" in expected[1]
    assert expected[0]["trainer/consumed_tokens"] < 8 * 32  # the ignored labels are there


#: name -> the strategy's flags, on 4 ranks
FOUR_RANKS = {
    "pp4": ["--strategy.pp", "4", "--strategy.pipeline_layout", "[0, 1, 1, 0]"],
    # dp=2: DualPipeV's 4 microbatches per replica in microbatches of 1
    "pp2_ep2": ["--strategy.pp", "2", "--strategy.ep", "2", "--strategy.schedule", "dualpipev",
                "--strategy.pipeline_layout", "[1, 0, 1, 0]", "--strategy.ranks_per_node", "1",
                "--trainer.micro_batch_size", "1"],
    "pp2_tp2_sp": ["--strategy.pp", "2", "--strategy.tp", "2", "--strategy.sequence_parallel",
                   "true", "--strategy.schedule", "dualpipev",
                   "--strategy.pipeline_layout", "[1, 0, 1, 0]"],
}  # fmt: skip


def _four_layouts(rank: int, world_size: int, root: Path, env: dict) -> list:
    """Each of FOUR_RANKS' commands in turn on this rank: (exit code, stderr tail) each."""
    return [
        _command_on_rank(  # the flags last: they override the common ones
            rank, world_size, [*_argv(root / name, "--strategy", "megatron"), *flags], env
        )
        for name, flags in FOUR_RANKS.items()
    ]


def test_pp4_pp2_ep2_and_pp2_tp2_sp_under_the_cli_match_one_process(tmp_path, one):
    env = {"NANOTRAIN_CACHE": str(tmp_path / "cache")}
    ranks = run_world(_four_layouts, 4, tmp_path, env, timeout=400)
    for rank, runs in enumerate(ranks):
        assert [code for code, _ in runs] == [0] * len(FOUR_RANKS), (rank, runs)
    for name in FOUR_RANKS:
        report = next((tmp_path / name).glob("*/version_0/report.md")).read_text()
        assert "pp=" in report, name
        _assert_same_records(one, tmp_path / name)


def test_dualpipev_under_the_cli_matches_one_process(tmp_path, one):
    env = {"NANOTRAIN_CACHE": str(tmp_path / "cache")}
    piped = tmp_path / "pp2"
    strategy = ["--strategy", "megatron", "--strategy.pp", "2",
                "--strategy.schedule", "dualpipev", "--strategy.overlap_forward_backward", "true",
                "--strategy.pipeline_layout", "[1, 0, 1, 0]"]  # fmt: skip
    ranks = run_world(_command_on_rank, 2, _argv(piped, *strategy), env, timeout=240)
    assert [code for code, _ in ranks] == [0, 0], ranks
    report = next(piped.glob("*/version_0/report.md")).read_text()
    assert "pp=2" in report and "schedule=dualpipev" in report
    _assert_same_records(one, piped)

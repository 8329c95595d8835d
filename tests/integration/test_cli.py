"""`nanotrain fit | validate | prepare` from the shell: the README's command, configs, errors."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nanotrain.cli import main

REPO = Path(__file__).resolve().parents[2]

# A demo corpus small enough to prepare in a second; the subprocess runs use the same one.
SMALL_DEMO = ["--data.init_args.demo_max_bytes", "300000"]


def readme_fit_command() -> list[str]:
    """The `nanotrain fit ...` part of the README's first set-up command."""
    text = (REPO / "README.md").read_text()
    for line in text.splitlines():
        if "nanotrain fit" in line and "pip install" in line:
            command = line[line.index("nanotrain fit") :].strip().strip("`")
            return shlex.split(command)
    raise AssertionError("README.md has no set-up line that installs and runs `nanotrain fit`")


def run_cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "NANOTRAIN_CACHE": str(tmp_path / "cache"), **env}
    environment.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, "-m", "nanotrain", *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one TensorBoard scalar, read with tensorboard's own reader."""
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_readme_main_command_trains_and_writes_tensorboard(tmp_path):
    command = readme_fit_command()
    assert command[:2] == ["nanotrain", "fit"]
    # the one real subprocess of this file (the README promises a shell command), as short as
    # its checks allow: two logged steps apart, a validation before and after training
    result = run_cli(
        command[1:]
        + [
            "--trainer.max_steps",
            "4",
            "--trainer.log_every_n_steps",
            "2",
            "--trainer.val_check_interval",
            "4",
            "--trainer.limit_val_batches",
            "2",
            "--trainer.default_root_dir",
            str(tmp_path / "runs"),
            *SMALL_DEMO,
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = list((tmp_path / "runs").glob("*/version_0"))
    assert len(run_dirs) == 1, list((tmp_path / "runs").rglob("*"))
    run_dir = run_dirs[0]
    losses = scalars(run_dir, "train/loss")
    assert [step for step, _ in losses] == [1, 3]  # steps 2 and 4 (logged 0-based)
    assert all(0 < value < 10 for _, value in losses)
    # the demo config validates at step 0 too (validate_at_start), so the curve starts at the
    # untrained model's bits per byte: about log2(257) = 8 for uniform bytes
    (start, start_bpb), (val_step, val_bpb) = scalars(run_dir, "val/bpb")
    assert start == 0 and 7 < start_bpb < 9
    assert val_step == 3 and 0 < val_bpb < start_bpb  # after step 4
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "report.md").is_file() and (run_dir / "report/loss.png").is_file()
    # the first run's screen: no Python warning (CPU has no peak FLOP/s: said once, in the
    # summary), then a closing summary with the final validation and where everything is
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    summary = result.stdout[result.stdout.index("finished: 4 steps") :]
    (last_loss,) = [value for step, value in scalars(run_dir, "val/loss") if step == 3]
    assert (
        f"last validation (step 4): val/loss {last_loss:.4f} | {val_bpb:.4f} bits per byte"
        in summary
    )
    assert re.search(r"\d tokens/s; MFU n/a: no peak FLOP/s is known for cpu", summary)
    assert f"run folder:  {run_dir}" in summary
    assert f"report:      {run_dir / 'report.md'}" in summary
    assert f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}" in summary


def test_unknown_config_key_is_rejected(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  max_steps: 5\n  max_stepz: 10\n")
    assert main(["fit", "--config", str(config)]) == 2  # a user error: one line, exit code 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("nanotrain: error: ") and "max_stepz" in line


def test_print_config_shows_resolved_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            ["fit", "--config", str(REPO / "examples/configs/tiny_deepseek.yaml"), "--print_config"]
        )
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert re.search(r"max_steps: \d+", printed)
    assert "LanguageModelModule" in printed and "TokenDataModule" in printed


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "examples/configs").glob("*.yaml")))
def test_every_example_config_parses(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(REPO / "examples/configs" / name), "--print_config"])
    assert exc.value.code == 0
    assert "LanguageModelModule" in capsys.readouterr().out


def test_seed_config_builds_the_seed_projects_model():
    # the nano-train seed project's default model has 2,173,792 parameters (issue 18)
    import yaml

    import nanotrain as nt

    cfg = yaml.safe_load((REPO / "examples/configs/nano_train_seed.yaml").read_text())
    init_args = dict(cfg["model"]["init_args"], compile_layers=False, compile_model=False)
    module = nt.LanguageModelModule(**init_args)
    module.configure_model()
    assert sum(p.numel() for p in module.model.parameters()) == 2_173_792


def test_missing_data_path_is_a_clear_error(tmp_path, capsys):
    argv = ["fit", "--trainer.max_steps", "2", "--data.init_args.data_path", str(tmp_path / "nope"),
            "--trainer.default_root_dir", str(tmp_path / "runs"), "--callbacks", "[]"]  # fmt: skip
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "nope" in line and "nanotrain prepare" in line


def test_indivisible_batch_sizes_fail_before_training(tmp_path, capsys):
    argv = [
        "fit",
        "--trainer.max_steps",
        "2",
        "--trainer.global_batch_size",
        "10",
        "--trainer.micro_batch_size",
        "4",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    assert main(argv) == 2  # a user error: one line on stderr, exit code 2
    assert "global_batch_size=10 is not a multiple of micro_batch_size=4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="global_batch_size=10 is not a multiple"):
        main([*argv, "--debug"])  # --debug lets the exception through


def test_prepare_then_fit_and_validate_on_prepared_data(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox. " * 400)
    out = tmp_path / "shards"
    assert (
        main(["prepare", "--inputs", str(corpus), "--out", str(out), "--val_fraction", "0.25"]) == 0
    )
    common = [
        "--data.init_args.data_path",
        str(out),
        "--data.init_args.seq_len",
        "32",
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
        "--callbacks",
        "[]",
    ]
    config = ["--config", str(REPO / "examples/configs/tiny_deepseek.yaml"), *common]
    limits = ["--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"]
    assert main(["fit", *config, "--trainer.max_steps", "3", *limits]) == 0
    capsys.readouterr()
    assert main(["validate", *config, *limits]) == 0
    assert re.search(r"val/loss: \d", capsys.readouterr().out)


def test_strategy_alias_fsdp_builds_fsdp_strategy():
    # `--strategy fsdp` is Lightning's FSDP spelling: nanotrain's FSDPStrategy (ZeRO-3)
    from nanotrain.cli.commands import run_parser
    from nanotrain.cli.parser import expand_strategy_alias
    from nanotrain.strategies import FSDPStrategy

    parser = run_parser("fit")
    argv = ["--config", str(REPO / "examples/configs/tiny_deepseek.yaml"), "--strategy", "fsdp"]
    argv += ["--strategy.sharding_strategy", "SHARD_GRAD_OP"]
    config = parser.parse_args(expand_strategy_alias(argv))
    del config.trainer.logger  # as the command: the logger is built apart from the config
    strategy = parser.instantiate(config).strategy
    assert type(strategy) is FSDPStrategy
    assert strategy.zero_stage == 3 and strategy.reshard_after_forward is False


def test_context_extension_example_parses_with_cp_and_yarn():
    # the 4K -> 32K stage: cp set, weights from an exported model folder, YaRN stretching the
    # 4,096 original positions to the data's sequence length
    from nanotrain.cli.commands import run_parser

    path = REPO / "examples/configs/context_extension_32k.yaml"
    config = run_parser("fit").parse_args(["--config", str(path)])
    assert config.strategy.class_path == "nanotrain.MegatronStrategy"
    assert config.strategy.init_args.cp == 4
    module = config.model.init_args
    yarn = module.model_overrides["rope_scaling"]
    seq_len = config.data.init_args.seq_len
    assert module.model_overrides["max_seq_len"] == seq_len == 32768
    assert (
        yarn["type"] == "yarn"
        and yarn["original_max_position_embeddings"] * yarn["factor"] == seq_len
    )

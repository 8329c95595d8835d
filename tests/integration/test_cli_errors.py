"""Every user error of the `nanotrain` command is one line on stderr (rank 0 only) with exit
code 2; `--debug` / NANOTRAIN_DEBUG=1 give the traceback. The cases run in-process through
the command's entry point (a process each would only repeat the imports); those that need
two ranks run it on forked gloo worlds. A bug in user code on one rank under torchrun, inside
the SLURM recipe (`slurm_recipe`), is part of tests/integration/test_torchrun_restart.py's
torchrun job (a job of its own would only add three fresh interpreters)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import traceback
from pathlib import Path

import pytest

from nanotrain.cli import main
from nanotrain.data.prepare import prepare
from nanotrain.data.tokenizers import train_bpe
from nanotrain.testing import Classifier
from tests.distributed.spawn import run_world

REPO = Path(__file__).resolve().parents[2]
SMALL_DEMO = ["--data.init_args.demo_max_bytes", "300000"]
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"
HINT = "(--debug or NANOTRAIN_DEBUG=1 for the traceback)"


def deepseek_style_tokenizer(tmp: Path) -> Path:
    """A tokenizer.json whose end-of-text token is DeepSeek's, not one nanotrain knows."""
    path = tmp / "tok" / "tokenizer.json"
    train_bpe(["hello world, " * 50, "the quick brown fox " * 50], 300, path)
    path.write_text(path.read_text(encoding="utf-8").replace("<|endoftext|>", DEEPSEEK_EOS))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """A prepared data folder whose metadata claims a token id (300) the model cannot embed,
    a corpus, and a tokenizer whose end-of-text token nanotrain does not know."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    corpus = tmp / "corpus.txt"
    corpus.write_text("some text to tokenize.\n" * 400)
    folder = prepare([corpus], tmp / "data", val_fraction=0.25)
    meta = json.loads((folder / "metadata.json").read_text())
    meta["max_token_id"] = 300  # as if prepared with a larger tokenizer than the model's
    (folder / "metadata.json").write_text(json.dumps(meta))
    return {
        "tmp": tmp,
        "corpus": corpus,
        "data": folder,
        "tokenizer": deepseek_style_tokenizer(tmp),
    }


def cases(data: dict[str, Path]) -> dict[str, list[str]]:
    """The command lines of every user-error case, by name (also those run under torchrun)."""
    tmp, corpus, tokenizer = data["tmp"], data["corpus"], data["tokenizer"]
    root = ["--trainer.default_root_dir", str(tmp / "runs")]
    return {
        "virtual_pp": ["fit", "--strategy", "megatron", "--strategy.init_args.virtual_pp", "0"],
        "prefix": ["fit", "--trainer.max_step", "5"],
        "limit_val": ["fit", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1.5"],
        "strategy": ["fit", "--strategy", "bogus"],
        "seq_len": ["fit", "--trainer.max_steps", "1", "--data.init_args.seq_len", "512",
                    *SMALL_DEMO, *root],
        "token_ids": ["fit", "--trainer.max_steps", "1", "--data.init_args.data_path",
                      str(data["data"]), "--model.init_args.vocab_size", "257", *root],
        "no_eos": ["prepare", "--inputs", str(corpus), "--out", str(tmp / "p1"),
                   "--tokenizer", str(tokenizer)],
    }  # fmt: skip


class FailsOnRankOne(Classifier):
    """A module whose `setup` refuses the data on global rank 1 only, after the process group
    exists: rank 0 meanwhile waits in the next collective."""

    def setup(self, stage: str) -> None:
        if self.trainer.global_rank == 1:
            raise ValueError("rank 1 found a shard it cannot read (planted by the test)")


def slurm_recipe(tmp: Path, launch: list[str]) -> list[str]:
    """docs/checkpointing.md's SLURM script as a bash command, its launch line replaced by
    `launch` (the SBATCH lines are comments to bash), with a stand-in `scontrol` on PATH that
    logs its arguments to <tmp>/scontrol.log."""
    text = (REPO / "docs" / "checkpointing.md").read_text()
    block = text.split("### SLURM", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines, skipping = [], False
    for line in block.strip().splitlines():
        if line.startswith("srun "):
            lines.append(" ".join(shlex.quote(a) for a in launch))
            skipping = line.endswith("\\")
        elif skipping:
            skipping = line.endswith("\\")
        else:
            lines.append(line)
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "scontrol"
    stand_in.write_text(f'#!/bin/sh\necho "$@" >> {tmp / "scontrol.log"}\n')
    stand_in.chmod(0o755)
    script = tmp / "job.sh"
    script.write_text("\n".join(lines) + "\n")
    return ["bash", str(script)]


RANK_ONE_FAILS = ["fit", "--model", "tests.integration.test_cli_errors.FailsOnRankOne",
                  "--data", "nanotrain.testing.BlobsData", "--strategy", "ddp",
                  "--trainer.max_steps", "1"]  # fmt: skip


def _command_on_rank(rank: int, world_size: int, argv: list[str], env: dict[str, str]) -> tuple:
    """`nanotrain ...argv` on one rank of a forked gloo world, with the variables torchrun
    sets and `env`: (its exit code, or None when the error propagated; what it wrote to
    stderr, with the traceback of an error that propagated, as the process would print it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), **env)
    os.environ.pop("NANOTRAIN_DEBUG", None)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except Exception:  # noqa: BLE001 - --debug: the process would print it and exit 1
            traceback.print_exc()
            code = None
    return code, stderr.getvalue()


@pytest.fixture(scope="module")
def rank_runs(data) -> dict[str, list[tuple]]:
    """The other cases that need two ranks, each on a forked 2-rank world that runs the
    command's entry point (torchrun would only add fresh interpreters): an error every rank
    finds inside fit, a missing data folder found by rank 0's prepare_data while rank 1 waits
    at the barrier, and rank 1's own error with --debug. Each world ends when its erring rank
    leaves the process group, as a torchrun worker's exit does."""
    tmp = data["tmp"]
    every_rank = [*cases(data)["seq_len"], "--trainer.global_batch_size", "2",
                  "--trainer.default_root_dir", str(tmp / "both_runs")]  # fmt: skip
    missing = ["fit", "--config", "examples/configs/tiny_deepseek.yaml", "--strategy", "ddp",
               "--data.init_args.data_path", "/nonexistent",
               "--trainer.default_root_dir", str(tmp / "data_runs")]  # fmt: skip
    debug = [*RANK_ONE_FAILS, "--trainer.default_root_dir", str(tmp / "r1_runs"), "--debug"]
    runs = {"every_rank": every_rank, "data": missing, "rank1_debug": debug}
    # the exit record goes where a job script would name it, not next to the example config
    return {
        name: run_world(_command_on_rank, 2, argv, {
            "NANOTRAIN_CACHE": str(tmp / "cache"),
            "NANOTRAIN_EXIT_FILE": str(tmp / f"exit-{name}.json"),
        })
        for name, argv in runs.items()
    }  # fmt: skip


EXPECTED = {
    "virtual_pp": "virtual_pp must be >= 1, got 0",
    "strategy": "unknown strategy 'bogus': use one of the aliases auto, single, ddp, megatron, "
    "fsdp or a class path such as nanotrain.strategies.MegatronStrategy",
    "prefix": "unrecognized arguments: --trainer.max_step 5",
    "limit_val": "limit_val_batches=1.5: a float is a fraction of the batches and "
    "must lie in (0, 1] (1.0 = all); for a number of batches pass an int",
    "seq_len": "the data's seq_len=512 exceeds the model's max_seq_len=256; shorten "
    "--data.init_args.seq_len, or extend the RoPE tables explicitly with "
    "--model.init_args.model_overrides '{max_seq_len: 512}'",
    "token_ids": "the data holds token id 300 (tokenizer vocab_size 257) but the model's "
    "vocab_size is 257; set the model's vocab_size to at least 301 or prepare the data with a "
    "matching tokenizer",
    "no_eos": "has no end-of-text token among",
}


def _assert_one_line_error(returncode: int, stderr: str, case: str) -> None:
    assert returncode == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("nanotrain: error: ") and lines[0].endswith(HINT)
    assert EXPECTED[case] in lines[0]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_user_error_is_one_line_with_exit_code_2(data, case, capsys, monkeypatch):
    # in-process: the command's own code path (a process each would only repeat the imports)
    monkeypatch.delenv("NANOTRAIN_DEBUG", raising=False)
    monkeypatch.setenv("NANOTRAIN_CACHE", str(data["tmp"] / "cache"))
    returncode = main(cases(data)[case])
    _assert_one_line_error(returncode, capsys.readouterr().err, case)


def test_debug_flag_and_env_show_the_traceback(monkeypatch):
    # in-process the error propagates (a process then prints its traceback, exit code 1)
    monkeypatch.delenv("NANOTRAIN_DEBUG", raising=False)
    with pytest.raises(ValueError, match="unknown strategy 'bogus'"):
        main(["fit", "--debug", "--strategy", "bogus"])
    # the environment variable does the same
    monkeypatch.setenv("NANOTRAIN_DEBUG", "1")
    with pytest.raises(ValueError, match="unknown strategy 'bogus'"):
        main(["fit", "--strategy", "bogus"])
    monkeypatch.setenv("NANOTRAIN_DEBUG", "0")
    assert main(["fit", "--strategy", "bogus"]) == 2


def _nanotrain_frames(output: str) -> list[str]:
    # torchrun reports failed workers with a traceback of its own; the ranks must not
    return [ln for ln in output.splitlines() if "File " in ln and "nanotrain/" in ln]


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("nanotrain: error: ")]


def test_an_error_every_rank_finds_is_printed_once(rank_runs):
    (code0, err0), (code1, err1) = rank_runs["every_rank"]
    assert code0 == code1 == 2
    # one line for the job: the first rank to report prints it, the other stays quiet
    assert _error_lines(err0 + err1) == [f"nanotrain: error: {EXPECTED['seq_len']}  {HINT}"]
    assert not _nanotrain_frames(err0 + err1)


def test_a_data_error_of_rank_zero_is_one_line_and_its_waiting_peer_stays_quiet(rank_runs, data):
    (code0, err0), (code1, err1) = rank_runs["data"]
    (line,) = _error_lines(err0)
    assert code0 == 2 and "/nonexistent" in line
    # rank 1's barrier lost its peer: not its error to report (exit code 1, nothing printed)
    assert code1 == 1 and err1 == ""
    record = json.loads((data["tmp"] / "exit-data.json").read_text())
    assert record["reason"] == "user_error" and "/nonexistent" in record["message"]


def test_debug_gives_every_rank_its_own_traceback(rank_runs):
    (code0, err0), (code1, err1) = rank_runs["rank1_debug"]
    assert code1 is None and "planted by the test" in err1 and _nanotrain_frames(err1)
    # rank 0's collective lost rank 1: its own traceback says so (gloo words it either way,
    # depending on where in the transfer the peer went)
    lost = "Connection closed by peer" in err0 or "remote worker" in err0
    assert code0 is None and lost and _nanotrain_frames(err0), err0[-2000:]


def test_prepare_takes_an_eos_token(data):
    out = data["tmp"] / "p2"
    args = ["prepare", "--inputs", str(data["corpus"]), "--out", str(out)]
    assert main([*args, "--tokenizer", str(data["tokenizer"]), "--eos_token", DEEPSEEK_EOS]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["tokenizer"]["eos_token"] == DEEPSEEK_EOS


def test_lightning_cli_habits_seed_everything_logger_and_callbacks_plus(data, monkeypatch):
    import yaml

    tmp = data["tmp"]
    monkeypatch.setenv("NANOTRAIN_CACHE", str(tmp / "cache"))
    # not an error: LightningCLI habits on a real run
    code = main(["fit", "--seed_everything", "7", "--trainer.max_steps", "2", *SMALL_DEMO,
                 "--trainer.default_root_dir", str(tmp / "ok_runs"),
                 "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                 "--trainer.logger.save_dir", str(tmp / "user_csv"),
                 "--callbacks+", "nanotrain.callbacks.TextSampler", "--callbacks.prompts", "[Once]",
                 "--callbacks.every_n_steps", "1", "--callbacks.max_new_tokens", "2"])  # fmt: skip
    assert code == 0
    (run_dir,) = (tmp / "ok_runs").glob("*/version_*")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["seed_everything"] == 7 and config["trainer"]["seed"] == 7
    assert config["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    # --callbacks+ added the TextSampler to the defaults: the checkpoint callback still saved
    assert (run_dir / "samples.jsonl").is_file()
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()
    # the Lightning logger got the run's scalars (and took the place of the named ones)
    (metrics,) = (tmp / "user_csv").rglob("metrics.csv")
    assert "train/loss" in metrics.read_text().splitlines()[0]
    assert not (run_dir / "tensorboard").exists()

"""What the `nanotrain` command says and records when a run ends: the one-line message keeps
nanotrain's own sentence, run-folder problems are user errors, a rank whose peers left stays
quiet, and `exit.json` tells a wrapper script why the run ended."""

from __future__ import annotations

import json
import os

import pytest

from nanotrain.cli import main
from nanotrain.cli.errors import one_line, peer_gone
from nanotrain.runtime.exit_record import (
    EXIT_FILE_ENV,
    ExitRecorder,
    read_exit_record,
    reason_of_exit_code,
)
from nanotrain.runtime.run_files import RunFilesError

FAST = ["--trainer.max_steps", "2", "--data.init_args.demo_max_bytes", "100000",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_monitors", "false"]  # fmt: skip


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NANOTRAIN_DEBUG", raising=False)
    monkeypatch.delenv(EXIT_FILE_ENV, raising=False)
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def test_the_one_line_keeps_nanotrains_sentence_over_the_library_error_beneath():
    from nanotrain.checkpoint.files import read_meta

    def broken_meta(tmp):
        (tmp / "meta.json").write_text('{"format": "nanotrain\x01"}')
        return read_meta(tmp)

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(ValueError) as info:
            broken_meta(Path(folder))
    line = one_line(info.value)
    assert "meta.json is corrupt" in line and folder in line  # not JSON's own message alone


def test_a_library_error_alone_still_gives_its_message():
    try:
        try:
            raise json.JSONDecodeError("Expecting value", "x", 0)
        except json.JSONDecodeError as inner:
            raise ValueError("wrapped by a library") from inner
    except ValueError as exc:
        assert one_line(exc).startswith("Expecting value")


def test_peer_gone_errors_are_told_from_a_ranks_own_failure():
    closed = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:26532. This is typically caused by a remote worker crashing."
    )
    assert peer_gone(closed)
    assert peer_gone(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert not peer_gone(RuntimeError("CUDA out of memory"))
    assert not peer_gone(ValueError("Connection closed by peer"))  # a user error is not


@pytest.mark.parametrize("problem", ["file in the way", "read-only"])
def test_an_unwritable_run_folder_is_one_line_and_exit_2_before_any_step(
    tmp_path, capsys, monkeypatch, problem
):
    root = tmp_path / "root"
    if problem == "file in the way":
        root.write_text("not a folder")
    else:
        root.mkdir()
        os.chmod(root, 0o500)
        if os.access(root, os.W_OK):  # root ignores permission bits: simulate the mount
            real_mkdir = type(root).mkdir

            def read_only(self, *args, **kwargs):
                if str(self).startswith(str(root)):
                    raise OSError(30, "Read-only file system", str(self))
                return real_mkdir(self, *args, **kwargs)

            monkeypatch.setattr(type(root), "mkdir", read_only)
    # (with checkpointing on, the checkpoint folder's check says so first: test_checkpoint_*)
    no_ckpt = ["--trainer.enable_checkpointing", "false"]
    code = main(["fit", *FAST, *no_ckpt, "--trainer.default_root_dir", str(root)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and line.startswith("nanotrain: error: cannot write the run directory")
    assert str(root) in line and "--trainer.default_root_dir" in line
    cause = "a file is in the way" if problem == "file in the way" else "read-only"
    assert cause in line


def test_run_files_errors_are_user_errors_raised_by_the_trainer(tmp_path):
    import nanotrain as nt
    from nanotrain.testing import BlobsData, Classifier

    (tmp_path / "x").write_text("")
    trainer = nt.Trainer(
        max_steps=1, default_root_dir=str(tmp_path / "x"), loggers=[], enable_checkpointing=False
    )
    with pytest.raises(RunFilesError, match="a file is in the way"):
        trainer.fit(Classifier(), BlobsData())


def test_exit_json_says_why_a_run_ended(tmp_path, monkeypatch):
    env_file = tmp_path / "job" / "exit.json"
    monkeypatch.setenv(EXIT_FILE_ENV, str(env_file))
    root = tmp_path / "runs"
    assert main(["fit", *FAST, "--trainer.default_root_dir", str(root)]) == 0
    record = read_exit_record(env_file)
    assert record["reason"] == "finished" and record["exit_code"] == 0 and record["step"] == 2
    (run_dir,) = root.glob("*/version_*")
    assert read_exit_record(run_dir / "exit.json")["reason"] == "finished"
    assert record["run_dir"] == str(run_dir)
    # a user error before any run directory exists
    assert main(["fit", "--trainer.max_steps", "0"]) == 2
    record = read_exit_record(env_file)
    assert record["reason"] == "user_error" and record["exit_code"] == 2
    assert "max_steps must be a positive integer" in record["message"]


def test_without_the_variable_an_early_error_is_recorded_beside_the_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  max_steps: 0\n")
    assert main(["fit", "--config", str(config)]) == 2
    record = read_exit_record(f"{config}.exit.json")
    assert record["reason"] == "user_error" and "max_steps" in record["message"]


def test_a_crash_is_recorded_and_still_raised(tmp_path, monkeypatch):
    env_file = tmp_path / "exit.json"
    monkeypatch.setenv(EXIT_FILE_ENV, str(env_file))
    import nanotrain.trainer.trainer as trainer_module

    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(trainer_module.Trainer, "_train_loop", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        main(["fit", *FAST, "--trainer.default_root_dir", str(tmp_path / "runs")])
    record = read_exit_record(env_file)
    assert record["reason"] == "crashed" and "CUDA out of memory" in record["message"]


def test_a_rank_that_saw_its_peers_leave_keeps_their_record(tmp_path, monkeypatch):
    path = tmp_path / "exit.json"
    monkeypatch.setenv(EXIT_FILE_ENV, str(path))
    first = ExitRecorder(rank=1)
    first.active = True
    first.write("user_error", "the data path /x does not exist")
    follower = ExitRecorder(rank=0)
    follower.active = True
    follower.write("crashed", "another rank left the job first", only_over_running=True)
    assert read_exit_record(path)["reason"] == "user_error"
    follower.write("running")
    follower.write("crashed", "another rank left the job first", only_over_running=True)
    assert read_exit_record(path)["reason"] == "crashed"
    assert reason_of_exit_code(75) == "preempted" and reason_of_exit_code(3) == "nonfinite"
    assert reason_of_exit_code(0) == "finished" and reason_of_exit_code(9) == "crashed"
    assert not list(tmp_path.glob(".*.tmp"))  # atomic: no temporary left behind

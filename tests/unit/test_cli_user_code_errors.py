"""`nanotrain fit` tells a bug in the user's own code from a mistake in its input: an
exception raised in the user's module or callback keeps its traceback down to the user's
frame and ends the command with it (exit 1 under the console script, as under Lightning),
while nanotrain's own checks of the input stay one line with exit code 2; a full disk during a
checkpoint save is one line naming the folder and the bytes needed."""

from __future__ import annotations

import errno
import traceback

import pytest

import nanotrain as nt
from nanotrain.cli import main
from nanotrain.runtime.exit_record import EXIT_FILE_ENV, read_exit_record

FAST = ["--trainer.max_steps", "2", "--data.init_args.demo_max_bytes", "100000",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_monitors", "false"]  # fmt: skip


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NANOTRAIN_DEBUG", raising=False)
    monkeypatch.setenv(EXIT_FILE_ENV, str(tmp_path / "exit.json"))
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


class BuggyModule(nt.LanguageModelModule):
    """A user's module with a bug in its training step."""

    def training_step(self, batch, batch_idx):
        return "abc"["k"]


class ChecksInCallback(nt.Callback):
    """A user's callback that raises a ValueError of its own (a type the command also uses
    for input mistakes)."""

    def on_train_start(self, trainer, module):
        raise ValueError("my callback's own check failed")


def _frames(info) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(info.tb)]


def test_a_bug_in_the_users_step_keeps_its_traceback(tmp_path, capsys):
    root = ["--trainer.default_root_dir", str(tmp_path / "runs")]
    model = ["--model.class_path", f"{__name__}.BuggyModule", "--model.init_args.model", "tiny"]
    with pytest.raises(TypeError, match="string indices must be integers") as info:
        main(["fit", *FAST, *root, *model])
    assert "training_step" in _frames(info)  # down to the user's frame
    assert "nanotrain: error" not in capsys.readouterr().err
    assert read_exit_record(tmp_path / "exit.json")["reason"] == "crashed"


def test_a_value_error_raised_by_the_users_callback_keeps_its_traceback(tmp_path, capsys):
    root = ["--trainer.default_root_dir", str(tmp_path / "runs")]
    callback = ["--callbacks+", f"{__name__}.ChecksInCallback"]
    with pytest.raises(ValueError, match="my callback's own check") as info:
        main(["fit", *FAST, *root, *callback])
    assert "on_train_start" in _frames(info)
    assert "nanotrain: error" not in capsys.readouterr().err


def test_nanotrains_own_input_check_stays_one_line_and_exit_2(capsys):
    assert main(["fit", "--trainer.max_steps", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("nanotrain: error:") and "max_steps" in line


def test_a_full_disk_during_a_checkpoint_save_is_one_line(tmp_path, capsys, monkeypatch):
    import nanotrain.checkpoint.files as files

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files._HashingFile, "write", full)
    root = tmp_path / "runs"
    assert main(["fit", *FAST, "--trainer.default_root_dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    (folder,) = root.glob("*/version_*/checkpoints")
    assert line.startswith("nanotrain: error: no space left on the disk of " + str(folder))
    needed = int(line.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 100_000  # the tiny model's weights and optimizer state
    assert not list(folder.glob("*.tmp-*"))  # the partial save was removed

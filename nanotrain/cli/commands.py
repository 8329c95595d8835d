"""The commands of `nanotrain`: fit / validate (build the objects from the parsed config and
run them), prepare, export, import, env and report. `plan` is in `plan.py`."""

from __future__ import annotations

import warnings
from argparse import SUPPRESS
from typing import Any

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile, ArgumentParser, lazy_instance
from lightning.pytorch.loggers import Logger

from nanotrain.callbacks.base import Callback
from nanotrain.cli.parser import expand_strategy_alias, new_parser
from nanotrain.data import TokenDataModule
from nanotrain.language_model import LanguageModelModule
from nanotrain.module import NanoModule
from nanotrain.runtime.exit_record import ExitRecorder
from nanotrain.strategies import Strategy
from nanotrain.trainer.config import TrainerConfig


def run_parser(stage: str) -> ArgumentParser:
    """The parser of `nanotrain fit` or `nanotrain validate` (`stage`): `--config` YAML,
    sections trainer / strategy / model / data / callbacks, `--ckpt_path`, and for fit the
    planner flags."""
    parser = new_parser(prog=f"nanotrain {stage}", description=f"nanotrain {stage}")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_argument(
        "--seed_everything",
        type=bool | int | None,
        default=None,
        help="as LightningCLI: an int seeds the run (sets trainer.seed); true picks a random "
        "seed and records it in the config; default: trainer.seed",
    )
    parser.add_class_arguments(TrainerConfig, "trainer")
    logger_type = bool | Logger | list[Logger] | None
    parser.add_argument(
        "--trainer.logger",
        type=logger_type,
        default=True,
        help="as Lightning's Trainer(logger=...): true (the loggers named in trainer.loggers), "
        "false, or Lightning Logger classes, e.g. lightning.pytorch.loggers.CSVLogger",
    )
    # where trainer.logger is moved for instantiation (the trainer group builds TrainerConfig)
    parser.add_argument("--instantiated_logger", type=logger_type, default=True, help=SUPPRESS)
    parser.add_subclass_arguments(
        Strategy,
        "strategy",
        required=False,
        default=None,
        help="strategy class (or alias auto|single|ddp|megatron|fsdp); default: auto",
    )
    parser.add_subclass_arguments(
        NanoModule,
        "model",
        default=lazy_instance(LanguageModelModule),
        help="the NanoModule to train (default: LanguageModelModule)",
    )
    parser.add_subclass_arguments(
        pl.LightningDataModule,
        "data",
        default=lazy_instance(TokenDataModule),
        help="the data (default: TokenDataModule on the built-in demo corpus)",
    )
    parser.add_argument(
        "--callbacks",
        type=list[Callback] | None,
        default=None,
        help="callbacks added to the defaults (checkpoint, progress bar, NaN guard, LR, "
        "throughput, grad norm; one of the same class replaces the default); --callbacks+ X "
        "adds one",
    )
    parser.add_argument(
        "--ckpt_path", type=str | None, default=None, help="checkpoint to resume from, or 'last'"
    )
    if stage == "fit":
        parser.add_argument(
            "--plan", action="store_true", help="print the planner's memory / time estimate "
            "of this run (docs/planning.md) before starting it"
        )  # fmt: skip
        parser.add_argument(
            "--plan_gpu", type=str | None, default=None, help="device to plan for (h100, "
            "a100, ..., or a JSON spec); default: the CUDA device in use, or this CPU",
        )  # fmt: skip
        parser.add_argument(
            "--ignore_plan", action="store_true", help="start even when the planner says the "
            "layout does not fit the device's memory",
        )  # fmt: skip
    return parser


def run_fit(argv: list[str], recorder: ExitRecorder | None = None) -> Any:
    """`nanotrain fit`: parse, build, train; returns the Trainer (its `exit_code` is the
    command's)."""
    return run_fit_or_validate("fit", argv, recorder)


def run_validate(argv: list[str], recorder: ExitRecorder | None = None) -> Any:
    """`nanotrain validate`: parse, build, validate; returns the validation metrics."""
    return run_fit_or_validate("validate", argv, recorder)


def run_fit_or_validate(stage: str, argv: list[str], recorder: ExitRecorder | None = None) -> Any:
    """Parse `argv` for `fit`/`validate`, build the objects and run them; `recorder` records
    how the run ended (`exit.json`, see `nanotrain.runtime.exit_record`)."""
    from nanotrain.trainer import Trainer

    if recorder is not None:
        recorder.start()

    parser = run_parser(stage)
    config = parser.parse_args(expand_strategy_alias(argv))
    plan_args = {k: config.pop(k, None) for k in ("plan", "plan_gpu", "ignore_plan")}
    _apply_seed_everything(config)
    resolved = parser.dump(config, format="yaml")
    import yaml

    resolved_dict = yaml.safe_load(resolved)
    config.instantiated_logger = config.trainer.logger
    del config.trainer.logger
    objects = parser.instantiate(config)
    settings = vars(config.trainer) if not isinstance(config.trainer, dict) else config.trainer
    settings = {k: v for k, v in dict(settings).items() if not k.startswith("__")}
    callbacks: list[Callback] = list(objects.callbacks or [])  # the Trainer adds the defaults
    if stage == "fit":
        _check_plan(objects, settings, plan_args)
    trainer = Trainer(
        strategy=objects.strategy if objects.strategy is not None else "auto",
        callbacks=callbacks,
        config=resolved_dict,
        logger=objects.instantiated_logger,
        **settings,
    )
    if recorder is not None:
        recorder.trainer = trainer  # its run directory gets exit.json too
    if stage == "fit":
        trainer.fit(objects.model, objects.data, ckpt_path=config.ckpt_path)
        from nanotrain.cli.fit_summary import print_fit_summary

        print_fit_summary(trainer)
        return trainer
    return trainer.validate(objects.model, objects.data, ckpt_path=config.ckpt_path)


def _check_plan(objects: Any, settings: dict[str, Any], args: dict[str, Any]) -> None:
    """Print the run's plan (`--plan`) and refuse a layout that does not fit the device's
    memory, before any process group exists (`--ignore_plan` goes ahead anyway).

    The memory check runs with `--plan` or `--plan_gpu`, and unasked for MegatronStrategy
    runs on CUDA (against the device's own memory); other runs are not checked unasked.

    Raises:
        ValueError: the planner says the largest rank needs more memory than the device has.
    """
    import torch

    from nanotrain.cli.errors import is_rank_zero
    from nanotrain.cli.plan import is_megatron, plan_for_run
    from nanotrain.planning.report import format_plan

    asked = bool(args.get("plan")) or args.get("plan_gpu") is not None
    strategy = objects.strategy
    if strategy is None:
        from nanotrain.strategies import SingleDeviceStrategy

        strategy = SingleDeviceStrategy()
    # unasked, only CUDA runs of MegatronStrategy (the layouts the planner models exactly)
    if not asked and not (torch.cuda.is_available() and is_megatron(strategy)):
        return
    try:
        plan = plan_for_run(objects.model, objects.data, strategy, settings, args.get("plan_gpu"))
    except Exception as err:
        if asked:
            raise
        # the automatic check on CUDA must never be what stops a run the strategy accepts
        warnings.warn(
            f"the planner could not price this run ({err}); starting unchecked", stacklevel=2
        )
        return
    if plan is None:
        return
    if args.get("plan") and is_rank_zero():
        print(format_plan(plan), end="", flush=True)
    if not plan.fits and not args.get("ignore_plan"):
        raise ValueError(
            f"the planner says this layout does not fit: {'; '.join(plan.notes)}. Pick a "
            "layout that does (`nanotrain plan` lists them), or pass --ignore_plan to start "
            "anyway"
        )


def _apply_seed_everything(config: Any) -> None:
    """LightningCLI's `seed_everything`: an int becomes trainer.seed; true draws a random seed
    (recorded in the resolved config, so the run can be repeated); false/None keep trainer.seed."""
    value = config.seed_everything
    if value is None or value is False:
        return
    if value is True:
        import random

        value = random.randint(0, 2**31 - 1)
    config.trainer.seed = int(value)
    config.seed_everything = int(value)


def run_prepare(argv: list[str]) -> None:
    """`nanotrain prepare --inputs A [B ...] --out DIR [--tokenizer byte|tok.json]`: a corpus
    (Parquet, .jsonl / .json lines, .jsonl.gz, .jsonl.zst, text files, a datasets save_to_disk
    folder; files, folders or globs) → memory-mapped token shards + metadata.json."""
    from nanotrain.data.metadata import read_metadata
    from nanotrain.data.prepare import format_summary, prepare

    parser = new_parser(prog="nanotrain prepare", description=run_prepare.__doc__)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_argument(
        "--inputs",
        type=str,
        nargs="+",
        required=True,
        help="files, folders or globs: .parquet, .jsonl, .json (JSON lines), .jsonl.gz, "
        ".jsonl.zst, text files (one document each), datasets save_to_disk folders",
    )
    parser.add_argument("--out", type=str, required=True, help="output folder for the shards")
    parser.add_argument(
        "--tokenizer",
        type=str,
        default="byte",
        help="'byte' or the path of a Hugging Face tokenizer.json (or of its folder)",
    )
    parser.add_argument(
        "--eos_token",
        type=str | None,
        default=None,
        help="end-of-text token appended after each document, e.g. '<｜end▁of▁sentence｜>' "
        "(tokenizer.json only; default: the first known one in the vocabulary)",
    )
    parser.add_argument(
        "--text_field",
        type=str,
        default="text",
        help="JSON field / Parquet or datasets column that holds the text",
    )
    parser.add_argument("--shard_tokens", type=int, default=2**24, help="tokens per shard file")
    parser.add_argument(
        "--val_fraction",
        type=float,
        default=0.05,
        help="share of the text's bytes held out for validation, in [0, 1); chunks are picked "
        "without regard to their length, so validation's document lengths match training's",
    )
    parser.add_argument(
        "--split_chunk_chars",
        type=int,
        default=2**16,
        help="documents longer than this are cut into chunks of about this many characters "
        "before the train/val split",
    )
    parser.add_argument(
        "--num_workers",
        type=int | None,
        default=None,
        help="tokenizer processes (default: the CPU count); the output is the same for any",
    )
    parser.add_argument(
        "--progress",
        type=bool | None,
        default=None,
        help="draw documents, tokens and tokens/s while working (default: on a terminal)",
    )
    cfg = parser.parse_args(argv)
    out = prepare(
        cfg.inputs,
        cfg.out,
        cfg.tokenizer,
        cfg.text_field,
        cfg.shard_tokens,
        cfg.val_fraction,
        split_chunk_chars=cfg.split_chunk_chars,
        eos_token=cfg.eos_token,
        num_workers=cfg.num_workers,
        progress=cfg.progress,
    )
    print(format_summary(read_metadata(out), out))


def run_export(argv: list[str]) -> None:
    """`nanotrain export --to {hf,nanotrain} --ckpt PATH --out DIR`: a training checkpoint (any
    strategy, sharded MegatronStrategy ones included) as a transformers folder or a nanotrain
    weights folder."""
    from nanotrain.interop.weights import EXPORT_FORMATS, export_checkpoint

    parser = new_parser(prog="nanotrain export", description=run_export.__doc__)
    parser.add_argument("--to", type=str, default="hf", choices=list(EXPORT_FORMATS))
    parser.add_argument(
        "--ckpt",
        type=str,
        required=True,
        help="a nanotrain checkpoint, or a run's checkpoints folder or its `last` file",
    )
    parser.add_argument("--out", type=str, required=True, help="output folder")
    cfg = parser.parse_args(argv)
    export_checkpoint(cfg.ckpt, cfg.out, to=cfg.to)
    print(f"exported {cfg.ckpt} to {cfg.out} ({cfg.to})")


def run_import(argv: list[str]) -> None:
    """`nanotrain import --hf DIR --out DIR`: a transformers model as a nanotrain weights folder
    (model_config.json + model.safetensors) to train from with `--model.init_args.model DIR`."""
    from nanotrain.interop.weights import import_checkpoint

    parser = new_parser(prog="nanotrain import", description=run_import.__doc__)
    parser.add_argument(
        "--hf", type=str, required=True, help="folder with config.json + safetensors"
    )
    parser.add_argument("--out", type=str, required=True, help="output folder")
    cfg = parser.parse_args(argv)
    import_checkpoint(cfg.hf, cfg.out)
    print(f"imported {cfg.hf} to {cfg.out}")


def run_report(argv: list[str]) -> None:
    """`nanotrain report RUN_DIR`: (re)build report.md, report.json and the pictures of a run
    from its run directory."""
    from nanotrain.report import REPORT_MD, write_report

    parser = ArgumentParser(prog="nanotrain report", description=run_report.__doc__)
    parser.add_argument("run_dir", type=str, help="a run directory, e.g. runs/default/version_0")
    cfg = parser.parse_args(argv)
    write_report(cfg.run_dir)
    print(f"wrote {cfg.run_dir}/{REPORT_MD}")

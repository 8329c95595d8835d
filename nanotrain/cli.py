"""The `nanotrain` command: fit | validate | prepare | export | import | env | report.

`fit` and `validate` follow Lightning CLI conventions: a YAML `--config` with sections
`trainer`, `model`, `data`, `strategy`, `callbacks`, overridden by dotted flags such as
`--trainer.max_steps 50` or `--model.init_args.preset tiny`; `--print_config` prints the
resolved config and exits. Unknown keys are errors.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile, ArgumentParser, lazy_instance

from nanotrain.callbacks.base import Callback
from nanotrain.module import NanoModule
from nanotrain.strategies import Strategy
from nanotrain.trainer_config import TrainerConfig

STRATEGY_ALIASES = {
    "auto": None,
    "single": "nanotrain.strategies.SingleDeviceStrategy",
    "ddp": "nanotrain.strategies.DDPStrategy",
    "megatron": "nanotrain.strategies.MegatronStrategy",
}


def _expand_strategy_alias(argv: list[str]) -> list[str]:
    """Let `--strategy ddp` stand for `--strategy nanotrain.strategies.DDPStrategy`."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--strategy" and arg in STRATEGY_ALIASES:
            out.append(STRATEGY_ALIASES[arg] or "null")
        elif arg.startswith("--strategy=") and arg.split("=", 1)[1] in STRATEGY_ALIASES:
            out.append("--strategy=" + (STRATEGY_ALIASES[arg.split("=", 1)[1]] or "null"))
        else:
            out.append(arg)
    return out


def default_callbacks() -> list[Callback]:
    """Callbacks `nanotrain fit` uses when the config names none."""
    from nanotrain.callbacks import default_callbacks as make

    return make()


def _run_parser(stage: str) -> ArgumentParser:
    from nanotrain.data import TokenDataModule
    from nanotrain.language_model import LanguageModelModule

    parser = ArgumentParser(prog=f"nanotrain {stage}", description=f"nanotrain {stage}")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_class_arguments(TrainerConfig, "trainer")
    parser.add_subclass_arguments(
        Strategy,
        "strategy",
        required=False,
        default=None,
        help="strategy class (or alias auto|single|ddp|megatron); default: auto",
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
        help="callbacks; default: checkpoint, progress bar, LR, throughput, grad norm",
    )
    parser.add_argument(
        "--ckpt_path", type=str | None, default=None, help="checkpoint to resume from, or 'last'"
    )
    return parser


def run_fit_or_validate(stage: str, argv: list[str]) -> Any:
    """Parse `argv` for `fit`/`validate`, build the objects and run them."""
    from nanotrain.trainer import Trainer

    parser = _run_parser(stage)
    config = parser.parse_args(_expand_strategy_alias(argv))
    resolved = parser.dump(config, format="yaml")
    import yaml

    resolved_dict = yaml.safe_load(resolved)
    objects = parser.instantiate(config)
    settings = vars(config.trainer) if not isinstance(config.trainer, dict) else config.trainer
    settings = {k: v for k, v in dict(settings).items() if not k.startswith("__")}
    callbacks = objects.callbacks if objects.callbacks is not None else default_callbacks()
    trainer = Trainer(
        strategy=objects.strategy if objects.strategy is not None else "auto",
        callbacks=callbacks,
        config=resolved_dict,
        **settings,
    )
    if stage == "fit":
        trainer.fit(objects.model, objects.data, ckpt_path=config.ckpt_path)
        return trainer
    return trainer.validate(objects.model, objects.data, ckpt_path=config.ckpt_path)


def run_prepare(argv: list[str]) -> None:
    """`nanotrain prepare --inputs A [B ...] --out DIR [--tokenizer byte|tok.json]`: text (files,
    folders, globs, .jsonl) → memory-mapped token shards + metadata.json."""
    from nanotrain.data.metadata import read_metadata
    from nanotrain.data.prepare import format_summary, prepare

    parser = ArgumentParser(prog="nanotrain prepare", description=run_prepare.__doc__)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_argument(
        "--inputs",
        type=str,
        nargs="+",
        required=True,
        help="files, folders or globs of text / .jsonl",
    )
    parser.add_argument("--out", type=str, required=True, help="output folder for the shards")
    parser.add_argument(
        "--tokenizer",
        type=str,
        default="byte",
        help="'byte' or the path of a Hugging Face tokenizer.json",
    )
    parser.add_argument("--text_field", type=str, default="text", help="JSONL field with the text")
    parser.add_argument("--shard_tokens", type=int, default=2**24, help="tokens per shard file")
    parser.add_argument(
        "--val_fraction",
        type=float,
        default=0.05,
        help="fraction of documents held out for validation",
    )
    cfg = parser.parse_args(argv)
    out = prepare(
        cfg.inputs, cfg.out, cfg.tokenizer, cfg.text_field, cfg.shard_tokens, cfg.val_fraction
    )
    print(format_summary(read_metadata(out), out))


def run_export(argv: list[str]) -> None:
    """`nanotrain export --to {hf,nanotrain} --ckpt PATH --out DIR`: a training checkpoint (any
    strategy, sharded MegatronStrategy ones included) as a transformers folder or a nanotrain
    weights folder."""
    from nanotrain.model_io import EXPORT_FORMATS, export_checkpoint

    parser = ArgumentParser(prog="nanotrain export", description=run_export.__doc__)
    parser.add_argument("--to", type=str, default="hf", choices=list(EXPORT_FORMATS))
    parser.add_argument("--ckpt", type=str, required=True, help="a nanotrain checkpoint")
    parser.add_argument("--out", type=str, required=True, help="output folder")
    cfg = parser.parse_args(argv)
    export_checkpoint(cfg.ckpt, cfg.out, to=cfg.to)
    print(f"exported {cfg.ckpt} to {cfg.out} ({cfg.to})")


def run_import(argv: list[str]) -> None:
    """`nanotrain import --hf DIR --out DIR`: a transformers model as a nanotrain weights folder
    (model_config.json + model.safetensors) to train from with `--model.init_args.model DIR`."""
    from nanotrain.model_io import import_checkpoint

    parser = ArgumentParser(prog="nanotrain import", description=run_import.__doc__)
    parser.add_argument(
        "--hf", type=str, required=True, help="folder with config.json + safetensors"
    )
    parser.add_argument("--out", type=str, required=True, help="output folder")
    cfg = parser.parse_args(argv)
    import_checkpoint(cfg.hf, cfg.out)
    print(f"imported {cfg.hf} to {cfg.out}")


def run_env(argv: list[str]) -> None:
    """`nanotrain env [--json] [--ranks_per_machine N]`: torch, CUDA, NCCL, gloo, Transformer
    Engine, GPUs with the peak TFLOP/s used for MFU, CPU threads, default strategy and
    backend, and warnings for common misconfigurations."""
    from nanotrain.env_report import collect_environment, environment_json, format_environment

    parser = ArgumentParser(prog="nanotrain env", description=run_env.__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--ranks_per_machine",
        type=int | None,
        default=None,
        help="processes per machine to check threads for (default: LOCAL_WORLD_SIZE or 1)",
    )
    cfg = parser.parse_args(argv)
    env = collect_environment(cfg.ranks_per_machine)
    print(environment_json(env) if cfg.json else format_environment(env), end="")


def run_report(argv: list[str]) -> None:
    """`nanotrain report RUN_DIR`: (re)build report.md, report.json and the pictures of a run
    from its run directory."""
    from nanotrain.report import REPORT_MD, write_report

    parser = ArgumentParser(prog="nanotrain report", description=run_report.__doc__)
    parser.add_argument("run_dir", type=str, help="a run directory, e.g. runs/default/version_0")
    cfg = parser.parse_args(argv)
    write_report(cfg.run_dir)
    print(f"wrote {cfg.run_dir}/{REPORT_MD}")


COMMANDS = {
    "fit": lambda argv: run_fit_or_validate("fit", argv),
    "validate": lambda argv: run_fit_or_validate("validate", argv),
    "prepare": run_prepare,
    "export": run_export,
    "import": run_import,
    "env": run_env,
    "report": run_report,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nanotrain` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: nanotrain {{{','.join(COMMANDS)}}} [--help] ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    result = COMMANDS[argv[0]](argv[1:])
    if argv[0] == "validate" and isinstance(result, dict):
        for name, value in sorted(result.items()):
            print(f"{name}: {value:.6g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The parser every `nanotrain` command starts from, and the strategy aliases of `fit` /
`validate` (`--strategy ddp`). Light on purpose: no torch or Lightning import."""

from __future__ import annotations

from typing import Any

from jsonargparse import ArgumentParser

STRATEGY_ALIASES = {
    "auto": None,
    "single": "nanotrain.strategies.SingleDeviceStrategy",
    "ddp": "nanotrain.strategies.DDPStrategy",
    "megatron": "nanotrain.strategies.MegatronStrategy",
    "fsdp": "nanotrain.strategies.FSDPStrategy",
}


def strategy_value(value: str) -> str:
    """An alias as its class path; anything that is neither an alias nor a dotted class path
    (nor YAML / a dict) is refused with the list of aliases."""
    if value in STRATEGY_ALIASES:
        return STRATEGY_ALIASES[value] or "null"
    if "." not in value and not value.lstrip().startswith(("{", "null")):
        raise ValueError(
            f"unknown strategy {value!r}: use one of the aliases "
            f"{', '.join(STRATEGY_ALIASES)} or a class path such as "
            "nanotrain.strategies.MegatronStrategy"
        )
    return value


def expand_strategy_alias(argv: list[str]) -> list[str]:
    """Let `--strategy ddp` stand for `--strategy nanotrain.strategies.DDPStrategy`."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--strategy":
            out.append(strategy_value(arg))
        elif arg.startswith("--strategy="):
            out.append("--strategy=" + strategy_value(arg.split("=", 1)[1]))
        else:
            out.append(arg)
    return out


def new_parser(**kwargs: Any) -> ArgumentParser:
    """A jsonargparse parser that raises on errors (reported in one line by `main`) and takes
    no abbreviated flags (`--trainer.max_step` is an error, not `--trainer.max_steps`)."""
    return ArgumentParser(exit_on_error=False, allow_abbrev=False, **kwargs)

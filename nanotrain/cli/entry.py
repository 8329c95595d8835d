"""The `nanotrain` command: fit | validate | prepare | plan | export | import | env | report.

`fit` and `validate` follow Lightning CLI conventions: a YAML `--config` with sections
`trainer`, `model`, `data`, `strategy`, `callbacks`, overridden by dotted flags such as
`--trainer.max_steps 50` or `--model.init_args.model tiny`; `--print_config` prints the
resolved config and exits. Unknown keys and abbreviated flags are errors; a user error prints
one line (see `nanotrain.cli.errors`; `--debug` for the traceback).

This module imports nothing heavy: each command imports torch, Lightning and the rest of
nanotrain when it runs, so `nanotrain --help` answers at once.
"""

from __future__ import annotations

import importlib
import sys

from nanotrain.cli.errors import run_reporting_user_errors
from nanotrain.runtime.exit_record import ExitRecorder

# command -> (module, function taking argv); imported only when that command runs
COMMANDS = {
    "fit": ("nanotrain.cli.commands", "run_fit"),
    "validate": ("nanotrain.cli.commands", "run_validate"),
    "prepare": ("nanotrain.cli.commands", "run_prepare"),
    "plan": ("nanotrain.cli.plan", "run_plan"),
    "export": ("nanotrain.cli.commands", "run_export"),
    "import": ("nanotrain.cli.commands", "run_import"),
    "env": ("nanotrain.cli.env_report", "run_env"),
    "report": ("nanotrain.cli.commands", "run_report"),
}
RECORDED = ("fit", "validate")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nanotrain` console script: runs the command; a user error prints
    one line on global rank 0 and returns 2 (`--debug` / NANOTRAIN_DEBUG=1: the traceback)."""
    return run_reporting_user_errors(_main, list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str], recorder: ExitRecorder) -> int:
    """Dispatch `argv` to its command."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: nanotrain {{{','.join(COMMANDS)}}} [--help] ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, function = COMMANDS[argv[0]]
    command = getattr(importlib.import_module(module), function)
    # fit and validate record how they ended (nanotrain.runtime.exit_record)
    result = command(argv[1:], recorder) if argv[0] in RECORDED else command(argv[1:])
    if argv[0] == "validate" and isinstance(result, list):  # Trainer.validate: [metrics]
        for name, value in sorted(result[0].items()):
            print(f"{name}: {value:.6g}")
    return int(getattr(result, "exit_code", 0) or 0)  # fit: see nanotrain.runtime.exit_codes


if __name__ == "__main__":
    raise SystemExit(main())

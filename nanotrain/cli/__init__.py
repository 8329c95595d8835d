"""The `nanotrain` command: fit | validate | prepare | plan | export | import | env | report.

- `entry.py`: the console script: dispatches to a command, imports nothing heavy;
- `commands.py`: fit, validate, prepare, export, import, report;
- `parser.py`: the parser every command starts from, and the strategy aliases;
- `errors.py`: a user's mistake as one line and exit code 2;
- `plan.py`: `nanotrain plan`, and the layout check `fit` runs before building anything;
- `env_report.py`: `nanotrain env`.
"""

from nanotrain.cli.entry import main

__all__ = ["main"]

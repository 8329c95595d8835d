"""`python -m nanotrain ...` runs the `nanotrain` command (handy under torchrun)."""

from nanotrain.cli.entry import main

raise SystemExit(main())

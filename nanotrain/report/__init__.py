"""Run reports: `report.md`, `report.json` and pictures written into a run directory.

`write_report(run_dir)` builds them from what the run left behind (`run_info.json`,
`config.yaml`, the logged metrics, `checkpoints/`); the `RunReport` callback calls it when
`fit` ends, and `nanotrain report RUN_DIR` calls it on demand.
"""

from nanotrain.report.build import PICTURES_DIR, REPORT_JSON, REPORT_MD, build_report, write_report
from nanotrain.report.history import MetricHistory, read_history
from nanotrain.report.run_info import RUN_INFO_FILE, read_run_info

__all__ = [
    "PICTURES_DIR",
    "REPORT_JSON",
    "REPORT_MD",
    "RUN_INFO_FILE",
    "MetricHistory",
    "build_report",
    "read_history",
    "read_run_info",
    "write_report",
]

"""Plan a run before renting GPUs: per-rank memory, FLOPs, communication and step time of any
model on any `MegatronStrategy` layout, and a search over layouts. See docs/planning.md."""

from nanotrain.planning.layout import PRECISIONS, PlanLayout, Workload
from nanotrain.planning.rank_model import LayoutGroup, RankModel, build_rank_model, rank_models

__all__ = [
    "PRECISIONS",
    "LayoutGroup",
    "PlanLayout",
    "RankModel",
    "Workload",
    "build_rank_model",
    "rank_models",
]

"""Plan a run before renting GPUs: per-rank memory, FLOPs, communication and step time of any
model on any `MegatronStrategy` layout, and a search over layouts. See docs/planning.md.

    from nanotrain.planning import PlanLayout, Workload, gpu_spec, plan_layout, format_plan
    plan = plan_layout(config, PlanLayout(tp=2, pp=4, dp=8, ep=8, zero_stage=1),
                       Workload(seq_len=4096, micro_batch_size=1, global_batch_size=512,
                                precision="bf16-mixed"), gpu_spec("h100"))
    print(format_plan(plan))
"""

from nanotrain.planning.activations import ActivationEstimate, activation_estimate
from nanotrain.planning.comm_meter import CommMeter
from nanotrain.planning.communication import CommEstimate, comm_estimate
from nanotrain.planning.context_parallel import cp_layer_exchange_bytes
from nanotrain.planning.gpus import GPUS, GPUSpec, gpu_spec
from nanotrain.planning.layout import PRECISIONS, PlanLayout, Workload, balanced_pipeline_layout
from nanotrain.planning.memory import StateMemory, state_memory
from nanotrain.planning.plan import Plan, RankPlan, plan_layout
from nanotrain.planning.rank_model import LayoutGroup, RankModel, build_rank_model, rank_models
from nanotrain.planning.report import format_plan, format_search, plan_json, search_json
from nanotrain.planning.search import Rejected, SearchResult, search_layouts
from nanotrain.planning.seq_fit import format_seq_fits, seq_len_fits

__all__ = [
    "GPUS",
    "PRECISIONS",
    "ActivationEstimate",
    "CommEstimate",
    "CommMeter",
    "GPUSpec",
    "LayoutGroup",
    "Plan",
    "PlanLayout",
    "RankModel",
    "RankPlan",
    "Rejected",
    "SearchResult",
    "StateMemory",
    "Workload",
    "activation_estimate",
    "balanced_pipeline_layout",
    "build_rank_model",
    "comm_estimate",
    "cp_layer_exchange_bytes",
    "format_plan",
    "format_search",
    "format_seq_fits",
    "gpu_spec",
    "plan_json",
    "plan_layout",
    "rank_models",
    "search_json",
    "search_layouts",
    "seq_len_fits",
    "state_memory",
]

"""The model stack: DeepSeek-V3 (MLA, DeepSeekMoE, MTP) and a Llama-style dense transformer.

    from nanotrain.models import build_model, presets
    model = build_model(presets.get("tiny"))          # or device="meta" for instant shapes
    out = model(input_ids, labels=labels)             # ModelOutput: logits, loss, total_loss, ...
    out.total_loss.backward(); optimizer.step()
    model.update_router_biases()                      # aux-loss-free balancing, once per step

See docs/models.md for the architecture, the presets and the FLOPs formula.
"""

from nanotrain.models import presets
from nanotrain.models.accounting import active_params, flops_per_token, total_params
from nanotrain.models.build import build_model, init_weights
from nanotrain.models.compile import compile_layers, compile_model
from nanotrain.models.config import DeepSeekConfig, DenseConfig, ModelConfig
from nanotrain.models.deepseek import DeepSeekV3
from nanotrain.models.documents import DocumentMask, set_document_mask
from nanotrain.models.expert_compute import set_fp8_dispatch, set_fp8_expert_activations
from nanotrain.models.lazy import LazyTensor, open_safetensors
from nanotrain.models.recompute import RECOMPUTE_MODES
from nanotrain.models.transformer import CausalLM, DenseTransformer, ModelOutput, set_recompute

__all__ = [
    "RECOMPUTE_MODES",
    "CausalLM",
    "DeepSeekConfig",
    "DeepSeekV3",
    "DenseConfig",
    "DenseTransformer",
    "DocumentMask",
    "LazyTensor",
    "ModelConfig",
    "ModelOutput",
    "active_params",
    "build_model",
    "compile_layers",
    "compile_model",
    "flops_per_token",
    "init_weights",
    "open_safetensors",
    "presets",
    "set_document_mask",
    "set_fp8_dispatch",
    "set_fp8_expert_activations",
    "set_recompute",
    "total_params",
]

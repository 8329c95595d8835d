"""Logit parity with Hugging Face `transformers` (an independent implementation), both ways.

Export: our random tiny model -> `export_hf` -> `AutoModelForCausalLM.from_pretrained` gives
the same logits. Import: a random tiny `transformers` model -> `save_pretrained` ->
`import_hf` gives the same logits. fp32, eager attention, max abs diff <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nanotrain.interop.hf_io import export_hf, import_hf  # noqa: E402
from nanotrain.models.build import build_model  # noqa: E402
from nanotrain.models.config import DeepSeekConfig, DenseConfig  # noqa: E402

TOL = 1e-5
VOCAB = 64


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def deepseek(**overrides) -> DeepSeekConfig:
    base = dict(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, moe_intermediate_size=16, num_experts_per_tok=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, init_std=0.2, max_seq_len=64,
    )  # fmt: skip
    return DeepSeekConfig(**{**base, **overrides})


# yarn with factor = max_seq_len / original, as transformers expects
YARN = {
    "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
    "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
}  # fmt: skip

EXPORT_CASES = {
    "mla-no-qlora-one-group-mtp": deepseek(q_lora_rank=None, n_group=1, topk_group=1, mtp_depth=1),
    "mla-qlora-grouped-yarn": deepseek(
        q_lora_rank=16,
        n_group=4,
        topk_group=2,
        num_layers=3,
        first_k_dense_replace=2,
        rope_scaling=YARN,
    ),
    "mla-no-shared-experts": deepseek(
        q_lora_rank=None, n_group=2, topk_group=1, n_shared_experts=0
    ),
    "dense-gqa-yarn": DenseConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        init_std=0.2,
        max_seq_len=64,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),
}


@torch.no_grad()
def randomize_norms_and_router_bias(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights away from 1 and a nonzero router bias, so a mix-up in either would show."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))
        elif name.endswith("norm.weight"):  # not rotary tables, also 1-D buffers in HF
            tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=gen))


def ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


# transformers builds 0-wide shared experts when there are none, and torch warns about it
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("name", list(EXPORT_CASES))
def test_exported_checkpoint_gives_our_logits_in_transformers(name, tmp_path):
    config = EXPORT_CASES[name]
    gen = torch.Generator().manual_seed(0)
    ours = build_model(config, generator=gen).eval()
    randomize_norms_and_router_bias(ours, gen)
    export_hf(ours, config, tmp_path)

    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # only the MTP layer (index num_layers), which transformers does not load, is left over
    mtp_prefix = f"model.layers.{config.num_layers}."
    assert all(key.startswith(mtp_prefix) for key in info["unexpected_keys"])
    assert bool(info["unexpected_keys"]) == (getattr(config, "mtp_depth", 0) > 0)

    with torch.no_grad():
        expected = ours(ids()).logits
        got = theirs.eval()(ids()).logits
    assert (got - expected).abs().max().item() <= TOL

    if isinstance(config, DeepSeekConfig):
        # the router bias really steers routing here: without it the logits move
        with torch.no_grad():
            for module in theirs.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.zero_()
            unbiased = theirs(ids()).logits
        assert (unbiased - expected).abs().max().item() > 1e-3


def hf_deepseek_config(**overrides):
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
        qk_nope_head_dim=8, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64, initializer_range=0.2, num_mtp_layers=0,
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**base, **overrides})


IMPORT_CASES = {
    "mla-no-qlora-one-group": lambda: hf_deepseek_config(q_lora_rank=None, n_group=1, topk_group=1),
    "mla-qlora-grouped": lambda: hf_deepseek_config(
        q_lora_rank=16, n_group=4, topk_group=2, routed_scaling_factor=1.5, rope_interleave=False
    ),
    "llama-gqa-tied": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("name", list(IMPORT_CASES))
def test_imported_transformers_checkpoint_gives_its_logits(name, tmp_path):
    torch.manual_seed(0)
    hf_config = IMPORT_CASES[name]()
    hf_config._attn_implementation = "eager"
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    randomize_norms_and_router_bias(theirs, torch.Generator().manual_seed(2))
    theirs.save_pretrained(tmp_path)

    config, ours = import_hf(tmp_path)
    assert config.num_layers == hf_config.num_hidden_layers
    if config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight
    with torch.no_grad():
        expected = theirs(ids()).logits
        got = ours.eval()(ids()).logits
    assert (got - expected).abs().max().item() <= TOL

"""Config and key mapping to/from Hugging Face checkpoints, without `transformers` installed."""

from __future__ import annotations

import json

import pytest
import torch

from nanotrain.interop.hf import (
    config_from_hf,
    config_to_hf,
    state_dict_from_hf,
    state_dict_to_hf,
)
from nanotrain.interop.hf_io import export_hf, import_hf, read_hf_checkpoint
from nanotrain.models.build import build_model
from nanotrain.models.config import DeepSeekConfig, DenseConfig

VOCAB = 50


def deepseek(**overrides) -> DeepSeekConfig:
    base = dict(
        vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=24,
        q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        n_routed_experts=4, moe_intermediate_size=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, mtp_depth=1, max_seq_len=32,
    )  # fmt: skip
    return DeepSeekConfig(**{**base, **overrides})


def dense(**overrides) -> DenseConfig:
    base = dict(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2)
    return DenseConfig(**{**base, **overrides})


def random_state(config) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(v.shape, generator=gen) for k, v in build_model(config).state_dict().items()
    }


def test_config_round_trip_keeps_every_field():
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
    configs = [
        deepseek(q_lora_rank=None, rope_scaling=yarn, rope_interleave=False, mtp_loss_weight=0.1,
                 aux_loss_alpha=0.01, bias_update_speed=0.002, routed_scaling_factor=2.5),
        dense(tie_word_embeddings=True, rope_theta=500000.0, head_dim=8),
    ]  # fmt: skip
    for config in configs:
        assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


def test_config_to_hf_uses_transformers_names():
    hf = config_to_hf(deepseek(mtp_depth=1))
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["model_type"] == "deepseek_v3"
    assert hf["num_hidden_layers"] == 2 and hf["num_attention_heads"] == 2
    assert hf["num_key_value_heads"] == 2  # MLA has one key/value per head
    assert hf["num_nextn_predict_layers"] == 1 and hf["max_position_embeddings"] == 32
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    hf = config_to_hf(dense())
    assert hf["model_type"] == "llama" and hf["num_key_value_heads"] == 2 and hf["head_dim"] == 4


def test_config_from_deepseek_release_style_json():
    # the layout of DeepSeek-V3's own config.json: rope_theta + legacy rope_scaling, no
    # rope_parameters
    hf = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "n_routed_experts": 4,
        "moe_intermediate_size": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
        "max_position_embeddings": 32, "rope_theta": 5000,
        "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    }  # fmt: skip
    config = config_from_hf(hf)
    assert isinstance(config, DeepSeekConfig)
    assert config.rope_theta == 5000 and config.mtp_depth == 1 and config.q_lora_rank == 8
    assert config.rope_scaling == {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                   "mscale_all_dim": 1.0}  # fmt: skip


def test_state_dict_to_hf_names_and_unstacks_by_hand():
    config = deepseek()  # layer 0 dense, layer 1 MoE, one MTP module -> HF layer 2
    state = random_state(config)
    hf = state_dict_to_hf(config, state)
    assert torch.equal(hf["model.embed_tokens.weight"], state["embed_tokens.weight"])
    assert torch.equal(hf["lm_head.weight"], state["lm_head.weight"])
    assert torch.equal(hf["model.layers.1.mlp.experts.3.up_proj.weight"],
                       state["layers.1.mlp.experts.up_proj"][3])  # fmt: skip
    assert torch.equal(hf["model.layers.1.mlp.experts.0.down_proj.weight"],
                       state["layers.1.mlp.experts.down_proj"][0])  # fmt: skip
    assert torch.equal(hf["model.layers.1.mlp.gate.e_score_correction_bias"],
                       state["layers.1.mlp.gate.e_score_correction_bias"])  # fmt: skip
    assert torch.equal(hf["model.layers.2.eh_proj.weight"], state["mtp.0.eh_proj.weight"])
    assert torch.equal(hf["model.layers.2.shared_head.norm.weight"], state["mtp.0.norm.weight"])
    assert torch.equal(hf["model.layers.2.mlp.experts.1.gate_proj.weight"],
                       state["mtp.0.block.mlp.experts.gate_proj"][1])  # fmt: skip
    assert torch.equal(hf["model.layers.2.self_attn.q_a_proj.weight"],
                       state["mtp.0.block.self_attn.q_a_proj.weight"])  # fmt: skip
    # two MoE layers (main layer 1 + the MTP block): 3 stacked tensors become 3 * E each
    assert len(hf) == len(state) + 2 * 3 * (config.n_routed_experts - 1)


def test_state_dict_round_trip_is_exact():
    for config in (deepseek(), deepseek(q_lora_rank=None, n_shared_experts=0), dense()):
        state = random_state(config)
        back = state_dict_from_hf(config, state_dict_to_hf(config, state))
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)


def test_fused_transformers_expert_layout_is_accepted():
    config = deepseek(mtp_depth=0)
    state = random_state(config)
    hf = state_dict_to_hf(config, state)
    for name in ("gate_proj", "up_proj", "down_proj"):
        for e in range(config.n_routed_experts):
            del hf[f"model.layers.1.mlp.experts.{e}.{name}.weight"]
    # transformers' in-memory layout: [E, 2I, H] with the gate rows first, then [E, H, I]
    gate, up = state["layers.1.mlp.experts.gate_proj"], state["layers.1.mlp.experts.up_proj"]
    hf["model.layers.1.mlp.experts.gate_up_proj"] = torch.cat((gate, up), dim=1)
    hf["model.layers.1.mlp.experts.down_proj"] = state["layers.1.mlp.experts.down_proj"]
    back = state_dict_from_hf(config, hf)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_padded_vocab_rows_are_cut_and_tied_head_left_out():
    config = dense(tie_word_embeddings=True)
    state = random_state(config)
    # a tensor-parallel run pads the vocabulary with zero rows
    padding = torch.zeros(2, 16)
    padded = {**state, "embed_tokens.weight": torch.cat((state["embed_tokens.weight"], padding))}
    hf = state_dict_to_hf(config, padded)
    assert hf["model.embed_tokens.weight"].shape == (VOCAB, 16)
    assert "lm_head.weight" not in hf  # transformers re-ties it from the embedding
    back = state_dict_from_hf(config, hf)
    assert torch.equal(back["lm_head.weight"], state["embed_tokens.weight"])


@torch.no_grad()
def test_sharded_export_imports_to_the_same_model(tmp_path):
    config = deepseek()
    model = build_model(config, generator=torch.Generator().manual_seed(0)).eval()
    model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    export_hf(model, config, tmp_path, max_shard_bytes=4096)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()

    imported_config, imported = import_hf(tmp_path)
    assert imported_config == config
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(imported.eval()(ids).logits, model(ids).logits)
    original = model.state_dict()
    assert all(torch.equal(v, original[k]) for k, v in imported.state_dict().items())


def test_import_lowers_mtp_depth_when_the_weights_lack_it(tmp_path):
    export_hf(build_model(deepseek(mtp_depth=0)), deepseek(mtp_depth=0), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["num_nextn_predict_layers"] = 1  # what transformers' save_pretrained writes by default
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.warns(UserWarning, match="MTP"):
        config, model = import_hf(tmp_path)
    assert config.mtp_depth == 0 and len(model.mtp) == 0


def test_unsupported_settings_raise_with_the_fix():
    with pytest.raises(ValueError, match="scoring_func='sigmoid'"):
        config_to_hf(deepseek(scoring_func="softmax"))
    with pytest.raises(ValueError, match="lower n_group"):
        config_to_hf(deepseek(n_group=4, topk_group=2))  # 4 experts in 4 groups of one
    with pytest.raises(TypeError, match="DenseConfig or DeepSeekConfig"):
        config_to_hf({"hidden_size": 16})
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    quantized = dict(config_to_hf(deepseek()), quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match="dequantize"):
        config_from_hf(quantized)
    llama3_rope = dict(config_to_hf(dense()), rope_parameters={"rope_type": "llama3", "factor": 8})
    with pytest.raises(ValueError, match="yarn"):
        config_from_hf(llama3_rope)


def test_mismatched_checkpoints_raise_with_the_fix():
    config = dense()
    state = random_state(config)
    with pytest.raises(ValueError, match="Strip wrapper prefixes"):
        state_dict_to_hf(config, {"model." + k: v for k, v in state.items()})
    with pytest.raises(ValueError, match="shape"):
        state_dict_to_hf(dense(num_kv_heads=4), state)
    hf = state_dict_to_hf(config, state)
    with pytest.raises(ValueError, match="fp8"):
        fp8_scale = {"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1)}
        state_dict_from_hf(config, {**hf, **fp8_scale})
    del hf["model.norm.weight"]
    with pytest.raises(ValueError, match="missing.*norm.weight"):
        state_dict_from_hf(config, hf)


def test_reading_a_folder_without_weights_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(dense())))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        read_hf_checkpoint(tmp_path)

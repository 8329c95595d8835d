"""Merging a sharded MegatronStrategy checkpoint into whole-model weights, in one process.

One forked gloo world of 4 ranks trains for 2 steps and saves a sharded checkpoint under
tp=2 x ep=2 (dp=2) and pp=2 x tp=2 with the tiny DeepSeek (MLA, MoE, MTP: the last stage
holds an embedding copy), and under pp=2 x tp=2 with the tiny dense model with tied
embeddings; the vocabulary (257) is odd, so tp=2 pads the embedding and the head. Every
parameter and buffer is gathered there with the strategy's own collectives (`full_tensor`
over tp and ep, `all_gather_object` over pp). In the test process, without
`torch.distributed`, `merge_model_shards` must give exactly those tensors, and
`nanotrain export` must give a transformers model whose logits match our one-process model
loaded from the merged weights. The error tests damage copies of the tp=2 x ep=2 checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint.merge import merge_model_shards
from nanotrain.cli import main
from nanotrain.interop.weights import export_checkpoint, load_pretrained
from nanotrain.models import build_model, presets
from tests.distributed.spawn import run_world
from tests.unit.test_language_model import RandomTokens

pytestmark = pytest.mark.distributed

VOCAB = 257
# layout name -> (preset, config overrides, MegatronStrategy kwargs)
LAYOUTS = {
    "tp=2 x ep=2": ("tiny", {}, dict(tp=2, ep=2)),
    "pp=2 x tp=2": ("tiny", {}, dict(pp=2, tp=2)),
    "dense tied pp=2 x tp=2": ("tiny-dense", {"tie_word_embeddings": True}, dict(pp=2, tp=2)),
}
HEAD = "model.lm_head.weight"


def _gather_over_stages(strategy: Any, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's entries; where two stages hold a name (the embedding copy that MTP needs on
    the last stage), the first stage's."""
    if strategy.mesh.pp_size == 1:
        return named
    parts: list[dict] = [{} for _ in range(strategy.mesh.pp_size)]
    dist.all_gather_object(parts, named, group=strategy.mesh.pp_group)
    merged: dict[str, torch.Tensor] = {}
    for part in reversed(parts):
        merged.update(part)
    return merged


def _train(rank: int, world_size: int, root: str) -> dict[str, dict]:
    """Per layout: the saved checkpoint and (rank 0) the whole tensors gathered in the run."""
    results = {}
    for i, (name, (preset, overrides, layout)) in enumerate(LAYOUTS.items()):
        strategy = nt.MegatronStrategy(**layout)
        saver = ModelCheckpoint()  # saves when training ends
        trainer = nt.Trainer(
            strategy=strategy,
            max_steps=2,
            global_batch_size=4,
            micro_batch_size=2,
            default_root_dir=f"{root}/{i}",
            loggers=[],
            seed=3,
            callbacks=[saver],
        )
        module = nt.LanguageModelModule(
            model=preset, vocab_size=VOCAB, lr=1e-2, warmup_steps=1, model_overrides=overrides
        )
        trainer.fit(module, train_dataloaders=RandomTokens(16, VOCAB))
        params = dict(module.named_parameters())  # a tied weight once, under its first name
        whole = {n: strategy.full_tensor(n, p.detach()).clone() for n, p in params.items()}
        name_of = {id(p): n for n, p in params.items()}
        for key, tensor in module.state_dict(keep_vars=True).items():
            if key not in whole:  # buffers, and the tied head under the embedding's name
                tied = name_of.get(id(tensor))
                whole[key] = whole[tied] if tied is not None else tensor.detach().clone()
        whole = _gather_over_stages(strategy, whole)
        results[name] = {"ckpt": saver.last_model_path, "whole": whole if rank == 0 else None}
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict]:
    return run_world(_train, 4, str(tmp_path_factory.mktemp("merge")), timeout=120)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_merged_shards_equal_the_tensors_gathered_in_the_run(trained, layout):
    merged = merge_model_shards(trained[layout]["ckpt"])
    gathered = dict(trained[layout]["whole"])
    # an untied tp=2 head gathers with its padding row (257 -> 258); the merge drops it
    if gathered[HEAD].shape[0] == VOCAB + 1:
        gathered[HEAD] = gathered[HEAD][:VOCAB]
    assert merged.keys() == gathered.keys()
    preset, overrides, _ = LAYOUTS[layout]
    config = presets.get(preset, **{"vocab_size": VOCAB, **overrides})
    assert merged["model.embed_tokens.weight"].shape == (VOCAB, config.hidden_size)
    assert merged[HEAD].shape == (VOCAB, config.hidden_size)
    if preset == "tiny":
        assert merged["model.layers.1.mlp.experts.gate_proj"].shape[0] == config.n_routed_experts
    for name, tensor in gathered.items():
        assert torch.equal(merged[name], tensor), f"{layout}: {name} differs"
    # Lightning's habit: the module class rebuilds itself from the (sharded) checkpoint
    module = nt.LanguageModelModule.load_from_checkpoint(trained[layout]["ckpt"])
    assert module.training  # as Lightning: left in the mode it was built in
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, merged[name]), f"{layout}: {name} differs after loading"


@pytest.mark.parametrize("layout", ["pp=2 x tp=2", "dense tied pp=2 x tp=2"])
def test_last_stage_embedding_copy_equals_the_first_stages(trained, layout):
    # the merge takes the first stage's copy; training keeps both equal (summed gradients)
    ckpt = Path(trained[layout]["ckpt"])
    copies = []
    for rank in (0, 2):  # tp rank 0 of stage 0 and of stage 1
        with safe_open(str(ckpt / f"model-rank-{rank:05d}.safetensors"), "pt") as f:
            copies.append(f.get_tensor("model.embed_tokens.weight"))
    assert torch.equal(copies[0], copies[1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exported_sharded_checkpoint_runs_in_transformers_like_our_model(trained, layout, tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt = trained[layout]["ckpt"]
    assert main(["export", "--to", "hf", "--ckpt", ckpt, "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", "--to", "nanotrain", "--ckpt", ckpt, "--out", str(tmp_path / "nt")]) == 0

    config, weights = load_pretrained(tmp_path / "nt")
    merged = merge_model_shards(ckpt)
    assert weights.keys() == {k.removeprefix("model.") for k in merged}
    assert all(torch.equal(weights[k.removeprefix("model.")], v) for k, v in merged.items())
    ours = build_model(config, device="meta")
    ours.to_empty(device="cpu")
    ours.load_state_dict(weights)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", dtype=torch.float32
    )
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours.eval()(ids).logits
        got = theirs.eval()(ids).logits
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max().item() <= 1e-5


# -- damaged checkpoints: each error names the problem and what to do ---------------------------


@pytest.fixture
def damaged(trained, tmp_path) -> Path:
    """A copy of the tp=2 x ep=2 checkpoint to break."""
    return Path(shutil.copytree(trained["tp=2 x ep=2"]["ckpt"], tmp_path / "ckpt"))


def _edit_meta(ckpt: Path, **layout: Any) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["layout"] = None if layout.get("layout", 1) is None else {**meta["layout"], **layout}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_a_missing_shard_file_is_named(damaged):
    (damaged / "model-rank-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-rank-00003.safetensors is missing"):
        merge_model_shards(damaged)


def test_a_truncated_shard_is_reported(damaged):
    shard = damaged / "model-rank-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model-rank-00001.safetensors has .* truncated"):
        merge_model_shards(damaged)


def test_a_corrupt_shard_of_the_right_size_is_reported(damaged):
    shard = damaged / "model-rank-00002.safetensors"
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    with pytest.raises(ValueError, match="model-rank-00002.safetensors is corrupt"):
        merge_model_shards(damaged)


def test_a_layout_that_does_not_fit_the_shards_is_refused(damaged):
    _edit_meta(damaged, tp=1, dp=4)  # 4 ranks still, but the files hold tp=2 halves
    with pytest.raises(ValueError, match=r"tp=1, ep=2.*does not match the shard files"):
        merge_model_shards(damaged)


def test_a_layout_for_more_ranks_than_shard_files_is_refused(damaged):
    _edit_meta(damaged, dp=4, world_size=8)
    with pytest.raises(ValueError, match=r"world_size=4 does not match its layout .*=8"):
        merge_model_shards(damaged)


def test_an_unusable_layout_is_refused(damaged):
    _edit_meta(damaged, ep=3)  # ep must divide dp=2
    with pytest.raises(ValueError, match="unusable layout.*ep=3 does not divide dp=2"):
        merge_model_shards(damaged)


def test_a_stray_shard_file_is_refused(damaged):
    shutil.copy(damaged / "model-rank-00000.safetensors", damaged / "model-rank-00004.safetensors")
    with pytest.raises(ValueError, match=r"directory holds: unexpected \['model-rank-00004"):
        merge_model_shards(damaged)


def test_an_unsharded_checkpoint_points_to_load_model_weights(damaged):
    _edit_meta(damaged, layout=None)
    with pytest.raises(ValueError, match="not saved sharded.*load_model_weights"):
        merge_model_shards(damaged)


def test_a_model_of_another_config_is_refused(damaged):
    def holder(**overrides: Any) -> torch.nn.Module:
        module = torch.nn.Module()
        config = presets.get("tiny", **{"vocab_size": VOCAB, **overrides})
        module.add_module("model", build_model(config, device="meta"))
        return module

    with pytest.raises(
        ValueError, match=r"missing 17, e.g. \[.model.layers.2.*differs from the one"
    ):
        merge_model_shards(damaged, holder(num_layers=3))
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(129, 64\)"):
        merge_model_shards(damaged, holder(vocab_size=300))


def test_an_unknown_export_format_is_refused(damaged, tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        export_checkpoint(damaged, tmp_path / "out", to="onnx")

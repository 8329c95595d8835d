"""Starting a sharded MegatronStrategy layout from a folder of full (one-process) weights.

A tiny dense model (untied and tied embeddings) and the tiny DeepSeek (MLA, MoE, MTP) are
built once, perturbed away from any seed's initialisation (so a load that does nothing cannot
pass), and written as nanotrain weights folders. Forked worlds of 2 ranks (tp=2, tp=2 +
sequence parallel, ep=2, pp=2) and 4 ranks (tp=2 x pp=2 + sequence parallel, tp=2 x ep=2)
then start `LanguageModelModule(model=<folder>)` under each layout and train one step: the
weights gathered before that step must equal the file's exactly (padding rows of the tp=2
head zero) and the step's loss must equal the one-process loss of the same weights on the
same batch (relative 1e-5).

The checks of keys and shapes run in one process: a pipeline stage is built against a stand-in
mesh that only names its stage.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.interop import weights as model_io
from nanotrain.models import build_model, presets
from nanotrain.models.sharding import load_full_state_dict
from nanotrain.models.stages import build_pipeline_stage
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world

SEQ = 16  # divisible by tp=2 for sequence parallelism
BATCH = 4  # the whole data set: one optimizer step of 4 sequences
VOCAB = 257  # of both presets; odd, so tp=2 pads the embedding and the head
# name -> (preset, config overrides)
MODELS = {
    "dense": ("tiny-dense", {}),
    "dense-tied": ("tiny-dense", {"tie_word_embeddings": True}),
    "deepseek": ("tiny", {}),
}
# layout name -> (model, MegatronStrategy kwargs), per world size
WORLD2 = {
    "dense tp=2": ("dense", dict(tp=2)),
    "dense tied tp=2 + sequence parallel": ("dense-tied", dict(tp=2, sequence_parallel=True)),
    "dense tied pp=2 (embedding copy on the last stage)": ("dense-tied", dict(pp=2)),
    "deepseek ep=2": ("deepseek", dict(ep=2)),
    "deepseek pp=2 (MTP and embedding copy on the last stage)": ("deepseek", dict(pp=2)),
    "deepseek tp=2 + sequence parallel": ("deepseek", dict(tp=2, sequence_parallel=True)),
}
WORLD4 = {
    "deepseek tp=2 x pp=2 + sequence parallel": (
        "deepseek",
        dict(tp=2, pp=2, sequence_parallel=True),
    ),
    "deepseek tp=2 x ep=2 (shared experts over tp, routed over ep)": ("deepseek", dict(tp=2, ep=2)),
}


class Tokens(Dataset):
    """`BATCH` fixed random sequences as {"input_ids", "labels"} (shifted by one)."""

    def __init__(self, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def perturbed_model(preset: str, overrides: dict) -> torch.nn.Module:
    """The preset's one-process model with every weight, norm and router bias moved off its
    initial value (norms are all ones and router biases all zeros after init)."""
    torch.manual_seed(11)
    model = build_model(presets.get(preset, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.05, 0.05)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Per model: its weights folder and the one-process training-mode loss on the batch."""
    root = tmp_path_factory.mktemp("weights")
    out = {}
    for name, (preset, overrides) in MODELS.items():
        model = perturbed_model(preset, overrides)
        folder = model_io.save_weights(model.config, model.state_dict(), root / name)
        batch = Tokens(VOCAB).ids
        model.train()  # the loss a training step sees: aux and MTP terms included
        with torch.no_grad():
            loss = model(batch[:, :-1], batch[:, 1:]).total_loss
        out[name] = {"folder": str(folder), "loss": float(loss)}
    return out


class FirstStep(nt.Callback):
    """Gathers the whole parameters before the first step and keeps that step's loss."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.loss: float | None = None

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        strategy = trainer.strategy
        named = {
            n: strategy.full_tensor(n, p.detach()).clone() for n, p in module.named_parameters()
        }
        mesh = strategy.mesh
        if mesh.pp_size > 1:  # every stage's parameters on every rank
            parts: list[dict] = [{} for _ in range(mesh.pp_size)]
            dist.all_gather_object(parts, named, group=mesh.pp_group)
            named = {k: v for part in parts for k, v in part.items()}
        self.params = named
        self.buffers = {n: b.clone() for n, b in module.named_buffers() if n.endswith("_bias")}

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.loss = float(outputs.loss)


def _start_layouts(rank: int, world_size: int, root: str, exported: dict, layouts: dict) -> dict:
    """Start and train one step of every layout; what `FirstStep` saw, per layout."""
    results = {}
    for i, (name, (model, kwargs)) in enumerate(layouts.items()):
        probe = FirstStep()
        module = nt.LanguageModelModule(model=exported[model]["folder"])
        trainer = nt.Trainer(
            strategy=MegatronStrategy(**kwargs),
            max_steps=1,
            global_batch_size=BATCH,
            micro_batch_size=2,
            callbacks=[probe],
            default_root_dir=f"{root}/{i}",
            loggers=[],
            seed=5,  # another seed than the exported model's: only the load can match it
        )
        trainer.fit(module, train_dataloaders=Tokens(VOCAB))
        results[name] = {"loss": probe.loss, "params": probe.params, "buffers": probe.buffers}
    return results


@pytest.fixture(scope="module")
def world2(tmp_path_factory, exported) -> list[dict]:
    root = str(tmp_path_factory.mktemp("w2"))
    return run_world(_start_layouts, 2, root, exported, WORLD2, timeout=120)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, exported) -> list[dict]:
    root = str(tmp_path_factory.mktemp("w4"))
    return run_world(_start_layouts, 4, root, exported, WORLD4, timeout=120)


def assert_started_from_file(world: list[dict], layout: str, model: str, exported: dict) -> None:
    """Every rank saw the file's weights (gathered) and the one-process loss."""
    file = load_file(f"{exported[model]['folder']}/{model_io.WEIGHTS_FILE}")
    biases = {k for k in file if k.endswith("e_score_correction_bias")}  # buffers
    tied_alias = {"lm_head.weight"} if "tied" in model else set()  # one tensor, two names
    seen_biases = set()
    for rank, results in enumerate(world):
        got = results[layout]
        assert got["loss"] == pytest.approx(exported[model]["loss"], rel=1e-5), f"rank {rank}"
        params = {k.removeprefix(model_io.MODULE_PREFIX): v for k, v in got["params"].items()}
        assert params.keys() == file.keys() - biases - tied_alias, f"rank {rank}"
        for key, value in params.items():
            if key == "lm_head.weight" and value.shape[0] > VOCAB:  # the padded tp=2 head
                assert not value[VOCAB:].any(), f"rank {rank}: padding rows of {key}"
                value = value[:VOCAB]
            assert torch.equal(value, file[key]), f"rank {rank}: {key}"
        for key, value in got["buffers"].items():  # this rank's (stage's) router biases
            key = key.removeprefix(model_io.MODULE_PREFIX)
            assert torch.equal(value, file[key]), f"rank {rank}: {key}"
            seen_biases.add(key)
    assert seen_biases == biases


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(WORLD2))
def test_world2_start_holds_the_files_weights_and_gives_its_loss(world2, exported, layout):
    assert_started_from_file(world2, layout, WORLD2[layout][0], exported)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(WORLD4))
def test_world4_start_holds_the_files_weights_and_gives_its_loss(world4, exported, layout):
    assert_started_from_file(world4, layout, WORLD4[layout][0], exported)


def test_one_process_start_copies_the_file_exactly(exported):
    module = nt.LanguageModelModule(model=exported["deepseek"]["folder"])
    module.configure_model()
    file = load_file(f"{exported['deepseek']['folder']}/{model_io.WEIGHTS_FILE}")
    state = module.model.state_dict()
    assert state.keys() == file.keys()
    for key, value in file.items():
        assert torch.equal(state[key], value), key


def _stage(config: Any, pp_rank: int) -> torch.nn.Module:
    """Stage `pp_rank` of 2, built in this process (a stand-in mesh: no groups, no ranks)."""
    mesh = types.SimpleNamespace(pp_size=2, pp_rank=pp_rank, tp_group=None, ep_group=None)
    return build_pipeline_stage(config, mesh)


def test_a_pipeline_stage_needs_only_the_parameters_it_holds():
    source = perturbed_model("tiny-dense", {})
    full = source.state_dict()
    first = _stage(source.config, 0)  # embedding and layer 0
    theirs = ("layers.1.", "norm.", "lm_head.")
    mine = {k: v for k, v in full.items() if not k.startswith(theirs)}
    assert load_full_state_dict(first, mine) == ([], [])
    for key, value in first.state_dict().items():
        assert torch.equal(value, full[key]), key
    # the other stage's keys are the whole model's, hence expected rather than unexpected
    assert load_full_state_dict(first, full, strict=True) == ([], [])

    del mine["layers.0.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 parameter.*'layers.0.self_attn.q_proj"):
        load_full_state_dict(first, mine)
    # the last stage needs its embedding copy only when weights are tied (or for MTP)
    assert "embed_tokens.weight" not in _stage(source.config, 1).state_dict()


def test_strict_false_reports_and_keeps_what_does_not_match():
    source = perturbed_model("tiny-dense", {})
    full = dict(source.state_dict())
    del full["norm.weight"]
    full["layers.7.mlp.up_proj.weight"] = torch.zeros(1)
    target = build_model(source.config)
    before = target.norm.weight.clone()
    result = load_full_state_dict(target, full, strict=False)
    assert result.missing_keys == ["norm.weight"]
    assert result.unexpected_keys == ["layers.7.mlp.up_proj.weight"]
    assert torch.equal(target.norm.weight, before)
    assert torch.equal(target.lm_head.weight, source.lm_head.weight)


def test_bad_keys_and_shapes_are_refused_before_anything_is_copied():
    source = perturbed_model("tiny-dense", {})
    target = build_model(source.config)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    prefixed = {f"model.{k}": v for k, v in source.state_dict().items()}
    with pytest.raises(ValueError, match="strip the 'model.' prefix"):
        load_full_state_dict(target, prefixed)
    wrong = dict(source.state_dict())
    wrong["embed_tokens.weight"] = torch.zeros(300, 64)
    with pytest.raises(
        ValueError, match=r"'embed_tokens.weight' has shape \(300, 64\), the model's is \(257, 64\)"
    ):
        load_full_state_dict(target, wrong)
    with pytest.raises(TypeError, match=r"\['norm.weight'\] hold other values"):
        load_full_state_dict(target, {"norm.weight": [1.0]})
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), key

"""compile_layers=True trains like eager (single device, DDP, tensor parallel), parameter names
unchanged. The one-process test compiles with inductor (the default backend); the multi-rank
tests use the aot_eager backend: dynamo's tracing, graph breaks around the collectives and
AOT autograd are the same, without inductor's C++ code generation, which on a cold cache takes
minutes per rank on a 2-core machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nanotrain as nt
from nanotrain.models.transformer import DecoderLayer
from tests.distributed.spawn import run_world
from tests.unit.test_callbacks_moe_load import RandomTokens

AOT_EAGER = {"backend": "aot_eager"}


class _Losses(nt.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs.loss))


# the tiny DeepSeek model with MoE on fixed expert slots (no MTP)
CAPACITY_MOE = {"preset": "tiny", "overrides": {"capacity_factor": 1.0, "mtp_depth": 0}}


def _fit(
    tmp_path,
    compiled: bool | dict,
    strategy=None,
    preset: str = "tiny-dense",
    overrides=None,
    val_samples: int = 0,
    scope: str = "layers",
    recompute: str | None = None,
) -> tuple[list[float], list[str], nt.LanguageModelModule]:
    """Three steps of `preset`, then (with `val_samples`) one validation whose `val/loss`
    joins the losses; (losses, parameter names, the module). `scope`: "layers" passes
    `compiled` as compile_layers, "model" as compile_model."""
    torch.manual_seed(0)
    module = nt.LanguageModelModule(
        preset,
        vocab_size=257,
        model_overrides=overrides,
        recompute=recompute,
        **{f"compile_{scope}": compiled},
    )
    losses = _Losses()
    trainer = nt.Trainer(
        strategy=strategy or nt.SingleDeviceStrategy("cpu"),
        max_steps=3,
        global_batch_size=4,
        micro_batch_size=2,
        default_root_dir=str(tmp_path / str(bool(compiled))),
        loggers=[],
        callbacks=[losses],
        seed=0,
    )
    trainer.fit(module, train_dataloaders=RandomTokens(16))
    if val_samples:
        val = trainer.validate(module, dataloaders=RandomTokens(val_samples))
        losses.losses.append(val["val/loss"])
    layers = [m for m in module.model.modules() if isinstance(m, DecoderLayer)]
    compiled_layers = bool(compiled) and scope == "layers"
    assert layers and all((m._compiled_call_impl is not None) == compiled_layers for m in layers)
    assert (module.model._compiled_call_impl is not None) == (bool(compiled) and scope == "model")
    return losses.losses, list(module.model.state_dict()), module


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_layers_match_eager_losses(tmp_path):
    eager, names, _ = _fit(tmp_path, False)
    compiled, compiled_names, _ = _fit(tmp_path, True)
    assert compiled_names == names  # checkpoints stay interchangeable
    assert compiled == pytest.approx(eager, rel=1e-5)


def _ddp_rank(rank: int, world_size: int, root: str) -> list[float]:
    return _fit(Path(root), AOT_EAGER, nt.strategies.DDPStrategy())[0]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_layers_under_ddp_match_eager_single_process(tmp_path):
    # same global batch of 4 split over 2 ranks: the mean loss per step is the same
    _assert_two_ranks_match_eager(tmp_path, _ddp_rank, "ddp", timeout=240)


def _tp_rank(rank: int, world_size: int, root: str) -> list[float]:
    from nanotrain.strategies.megatron import MegatronStrategy

    return _fit(Path(root), AOT_EAGER, MegatronStrategy(tp=2))[0]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_layers_under_tensor_parallel_match_eager_single_process(tmp_path):
    _assert_two_ranks_match_eager(tmp_path, _tp_rank, "tp", timeout=300)


def _assert_two_ranks_match_eager(
    tmp_path: Path, rank_fn, name: str, timeout: float, model: dict | None = None
) -> None:
    """Every rank of a 2-rank compiled run logs the losses of the eager single process of
    the same model (`model`: `_fit`'s preset and overrides)."""
    model = model or {}
    eager = _fit(tmp_path, False, **model)[0]
    ranks = run_world(rank_fn, 2, str(tmp_path / name), timeout=timeout)
    for losses in ranks:
        assert losses == pytest.approx(eager, rel=1e-5)


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_deepseek_layer_with_capacity_experts_compiles_into_one_graph():
    # MLA attention (its rope) and the MoE block on fixed E x C slots (routing, slot ranks,
    # load counters, batched experts) trace as one graph: a graph break would split the layer
    # into pieces that run eagerly in between
    torch.manual_seed(0)
    module = nt.LanguageModelModule(
        "tiny", vocab_size=257, model_overrides=CAPACITY_MOE["overrides"]
    )
    module.configure_model()
    model = module.model
    moe_layer = model.layers[-1]
    assert hasattr(moe_layer.mlp, "experts")
    h = torch.randn(2, 16, model.config.hidden_size)
    cos, sin = model.rope(16, h.device)
    explanation = torch._dynamo.explain(moe_layer)(h, cos, sin)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_deepseek_with_capacity_experts_matches_eager(tmp_path):
    eager, _, eager_module = _fit(tmp_path, False, **CAPACITY_MOE)
    compiled, _, compiled_module = _fit(tmp_path, True, **CAPACITY_MOE)  # inductor
    assert compiled == pytest.approx(eager, rel=1e-5)
    # the load counter still counts inside a graph
    loads = [m.model.layers[-1].mlp.expert_load for m in (eager_module, compiled_module)]
    assert torch.equal(*loads)


def _sp_rank(rank: int, world_size: int, root: str) -> list[float]:
    from nanotrain.strategies.megatron import MegatronStrategy

    return _fit(Path(root), AOT_EAGER, MegatronStrategy(tp=2, sequence_parallel=True))[0]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_layers_under_sequence_parallel_match_eager_single_process(tmp_path):
    _assert_two_ranks_match_eager(tmp_path, _sp_rank, "sp", timeout=300)


def _sp_moe_rank(rank: int, world_size: int, root: str) -> list[float]:
    from nanotrain.strategies.megatron import MegatronStrategy

    strategy = MegatronStrategy(tp=2, sequence_parallel=True)
    return _fit(Path(root), AOT_EAGER, strategy, **CAPACITY_MOE)[0]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_capacity_moe_under_sequence_parallel_matches_eager_single_process(tmp_path):
    # the MoE gathers whole sequences over tp inside the compiled layer
    _assert_two_ranks_match_eager(tmp_path, _sp_moe_rank, "sp_moe", timeout=300, model=CAPACITY_MOE)


def _pp_rank(rank: int, world_size: int, root: str) -> list[float]:
    from nanotrain.strategies.megatron import MegatronStrategy

    return _fit(Path(root), AOT_EAGER, MegatronStrategy(pp=2), **CAPACITY_MOE)[0]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_layers_under_pipeline_parallel_match_eager_single_process(tmp_path):
    # each stage compiles its own layers; the executor between them stays eager
    _assert_two_ranks_match_eager(tmp_path, _pp_rank, "pp", timeout=300, model=CAPACITY_MOE)


def _ep_rank(rank: int, world_size: int, root: str) -> list[float]:
    from nanotrain.strategies.megatron import MegatronStrategy

    strategy = MegatronStrategy(ep=2)
    return _fit(Path(root), AOT_EAGER, strategy, **CAPACITY_MOE, val_samples=5)[0]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_layers_under_expert_parallel_match_eager_single_process(tmp_path):
    # The all-to-all of the expert slots breaks the graph; the rest of the layer compiles.
    # Validation on 5 samples (global batches of 4) ends with one sample on rank 0 and a
    # padding batch of two on rank 1: the ranks exchange their slot counts, eagerly
    model = dict(CAPACITY_MOE, val_samples=5)
    _assert_two_ranks_match_eager(tmp_path, _ep_rank, "ep", timeout=300, model=model)

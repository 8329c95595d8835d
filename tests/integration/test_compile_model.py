"""compile_model=True (the whole model as one graph) trains and validates like eager: one
process with inductor, 2 ranks under DDP, tp=2 with sequence parallelism and ep=2 with aot_eager
(see test_compile_layers.py for why); bad combinations fail before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nanotrain as nt
from nanotrain.models.compile import check_compile_options
from tests.distributed.spawn import run_world
from tests.integration.test_compile_layers import AOT_EAGER, CAPACITY_MOE, _fit

needs_compile = pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")


@needs_compile
def test_whole_model_with_capacity_experts_traces_as_one_graph():
    # embedding, MLA layers, MoE on fixed slots, final norm, head and masked CE: one graph,
    # so nothing between the layers runs eagerly
    torch.manual_seed(0)
    module = nt.LanguageModelModule(
        "tiny", vocab_size=257, model_overrides=CAPACITY_MOE["overrides"]
    )
    module.configure_model()
    ids = torch.randint(0, 257, (2, 17))
    explanation = torch._dynamo.explain(module.model)(ids[:, :-1], ids[:, 1:])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    # evaluation too (no slot-count exchange without expert parallelism)
    module.model.eval()
    with torch.no_grad():
        explanation = torch._dynamo.explain(module.model)(ids[:, :-1], ids[:, 1:])
    assert explanation.graph_break_count == 0, explanation.break_reasons


@needs_compile
def test_compiled_model_matches_eager_in_training_and_validation(tmp_path):
    # inductor; validation on 5 samples ends with a batch of one (a second shape)
    model = dict(CAPACITY_MOE, val_samples=5)
    eager, names, eager_module = _fit(tmp_path, False, **model)
    compiled, compiled_names, compiled_module = _fit(tmp_path, True, scope="model", **model)
    assert compiled_names == names  # checkpoints stay interchangeable
    assert compiled == pytest.approx(eager, rel=1e-5)
    loads = [m.model.layers[-1].mlp.expert_load for m in (eager_module, compiled_module)]
    assert torch.equal(*loads)


@needs_compile
@pytest.mark.parametrize(
    ("scope", "recompute", "backend"),
    [("model", "full", None), ("layers", "full", AOT_EAGER), ("model", "selective", AOT_EAGER)],
)
def test_compiled_recompute_matches_eager_without_recompute(tmp_path, scope, recompute, backend):
    # a checkpointed region inside a compiled graph: the MoE load counter, updated inside the
    # recomputed layer, must still count each token once (inductor for the whole model)
    eager, _, eager_module = _fit(tmp_path, False, **CAPACITY_MOE)
    compiled = backend or True
    got, _, module = _fit(tmp_path, compiled, scope=scope, recompute=recompute, **CAPACITY_MOE)
    assert got == pytest.approx(eager, rel=1e-5)
    loads = [m.model.layers[-1].mlp.expert_load for m in (eager_module, module)]
    assert torch.equal(*loads)


def _rank(rank: int, world_size: int, root: str, layout: str) -> list[float]:
    from nanotrain.strategies.megatron import MegatronStrategy

    strategy = {
        "ddp": nt.strategies.DDPStrategy,
        "tp2_sp": lambda: MegatronStrategy(tp=2, sequence_parallel=True),
        "ep2": lambda: MegatronStrategy(ep=2),
    }[layout]()
    return _fit(Path(root), AOT_EAGER, strategy, scope="model", **_model(layout))[0]


def _model(layout: str) -> dict:
    # under ep, validation on 5 samples (global batches of 4) leaves rank 0 one sample and
    # rank 1 a padding batch of two: the ranks exchange their expert slot counts
    return dict(CAPACITY_MOE, val_samples=5) if layout == "ep2" else CAPACITY_MOE


@needs_compile
@pytest.mark.parametrize("layout", ["ddp", "tp2_sp", "ep2"])
def test_compiled_model_on_two_ranks_matches_eager_single_process(tmp_path, layout):
    # tp2_sp puts the vocab-parallel embedding and cross-entropy collectives and the MoE's
    # all-gather of whole sequences inside the compiled forward; ep2 the expert all-to-all
    eager = _fit(tmp_path, False, **_model(layout))[0]
    ranks = run_world(_rank, 2, str(tmp_path / layout), layout, timeout=300)
    for losses in ranks:
        assert losses == pytest.approx(eager, rel=1e-5)


def test_compile_options_are_checked_before_any_work():
    with pytest.raises(ValueError, match="choose one"):
        nt.LanguageModelModule("tiny", compile_layers=True, compile_model=True)
    with pytest.raises(ValueError, match="compile_model must be True, False or a dict"):
        nt.LanguageModelModule("tiny", compile_model="yes")
    # the pipeline check runs in configure_model, once the strategy's mesh is known
    with pytest.raises(ValueError, match="pp=2 splits it into pipeline stages.*compile_layers"):
        check_compile_options(False, True, pp_size=2)
    check_compile_options(True, False, pp_size=2)  # per-layer compile works with stages
    check_compile_options({"backend": "aot_eager"}, False)

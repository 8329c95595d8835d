"""torch.compile trains like eager: `compile_model` (the whole model as one graph) and
`compile_layers` (each decoder layer), parameter names unchanged, under every layout.

One test compiles with inductor (the default backend: its generated code must reproduce the
eager losses); the others use the aot_eager backend: dynamo's tracing, graph breaks around the
collectives and AOT autograd are the same, without inductor's C++ code generation, which on a
cold cache takes minutes per model on a 2-core machine. The two-rank cases share one forked
world. Bad combinations fail before any work."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import nanotrain as nt
from nanotrain.models.compile import CPU_ISA_TAG, check_compile_options
from nanotrain.models.transformer import DecoderLayer
from tests.distributed.spawn import run_world
from tests.unit.test_callbacks_moe_load import RandomTokens

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")

AOT_EAGER = {"backend": "aot_eager"}
# the tiny DeepSeek model with MoE on fixed expert slots (no MTP)
CAPACITY_MOE = {"preset": "tiny", "overrides": {"capacity_factor": 1.0, "mtp_depth": 0}}
# the same with one decoder layer, an MoE layer: tracing costs grow with the graph
ONE_LAYER_MOE = {
    **CAPACITY_MOE,
    "overrides": {**CAPACITY_MOE["overrides"], "num_layers": 1, "first_k_dense_replace": 0},
}
# the dense model (`_fit`'s default preset) with one decoder layer
ONE_LAYER_DENSE = {"overrides": {"num_layers": 1}}


class _Losses(nt.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs.loss))


def _fit(
    tmp_path,
    compiled: bool | dict,
    strategy=None,
    preset: str = "tiny-dense",
    overrides=None,
    val_samples: int = 0,
    scope: str = "layers",
    recompute: str | None = None,
    micro_batch_size: int = 2,
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
        micro_batch_size=micro_batch_size,
        default_root_dir=str(tmp_path / f"{scope}-{bool(compiled)}-{recompute}"),
        loggers=[],
        callbacks=[losses],
        seed=0,
        enable_progress_bar=False,
        enable_monitors=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, train_dataloaders=RandomTokens(16))
    if val_samples:
        val = trainer.validate(module, dataloaders=RandomTokens(val_samples))[0]
        losses.losses.append(val["val/loss"])
    layers = [m for m in module.model.modules() if isinstance(m, DecoderLayer)]
    compiled_layers = bool(compiled) and scope == "layers"
    assert layers and all((m._compiled_call_impl is not None) == compiled_layers for m in layers)
    assert (module.model._compiled_call_impl is not None) == (bool(compiled) and scope == "model")
    return losses.losses, list(module.model.state_dict()), module


_EAGER: dict[str, tuple[list[float], list[str], nt.LanguageModelModule]] = {}


def _eager(tmp_path, **model) -> tuple[list[float], list[str], nt.LanguageModelModule]:
    """The one-process eager run of `model` (`_fit`'s keywords), fitted once per module: it
    is deterministic (seed 0), and several comparisons below share each model."""
    key = repr(sorted(model.items()))
    if key not in _EAGER:
        _EAGER[key] = _fit(tmp_path, False, **model)
    return _EAGER[key]


def _loads(module: nt.LanguageModelModule) -> torch.Tensor:
    return module.model.layers[-1].mlp.expert_load


def test_a_deepseek_layer_and_the_whole_model_trace_as_one_graph():
    # MLA attention (its rope), the MoE block on fixed E x C slots (routing, slot ranks, load
    # counters, batched experts), final norm, head and masked CE: a graph break would leave
    # pieces that run eagerly in between
    torch.manual_seed(0)
    module = nt.LanguageModelModule(
        "tiny", vocab_size=257, model_overrides=CAPACITY_MOE["overrides"]
    )
    module.configure_model()
    model = module.model
    h = torch.randn(2, 16, model.config.hidden_size)
    cos, sin = model.rope(16, h.device)
    explanation = torch._dynamo.explain(model.layers[-1])(h, cos, sin)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    ids = torch.randint(0, 257, (2, 17))
    # the whole model, called twice on a fresh thread (whose thread-local state no eager run
    # has made yet): one graph, and the second call reuses it instead of compiling again
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=count_graphs)
    with ThreadPoolExecutor(1) as fresh_thread:
        fresh_thread.submit(lambda: [compiled(ids[:, :-1], ids[:, 1:]) for _ in range(2)]).result()
    assert len(graphs) == 1, torch._dynamo.utils.counters["graph_break"]
    # evaluation too (no slot-count exchange without expert parallelism)
    model.eval()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids[:, :-1], ids[:, 1:])
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_inductor_compiled_model_with_recompute_matches_eager(tmp_path):
    # inductor's code for the whole model with a checkpointed region inside the graph: the
    # dense layer under full recompute is one graph. (A MoE layer under full recompute is
    # not: torch 2.13's dynamo does not trace a checkpointed region that updates a buffer,
    # the load counter, and runs that layer eagerly, see docs/performance.md; MoE layers
    # compiled with and without recompute are the aot_eager cases below.) Compiled
    # validation, with a last batch of another shape, runs under aot_eager below (ep=2): with
    # inductor it would double this test's time on a cold cache.
    # one layer: inductor's C++ build on a cold cache grows with the graph (~90 s of CPU for
    # a two-layer MoE model on a 2-core machine)
    model = ONE_LAYER_DENSE
    eager, names, _ = _eager(tmp_path, **model)
    torch._dynamo.utils.counters.clear()  # graphs other tests of this process compiled
    got, got_names, module = _fit(tmp_path, True, scope="model", recompute="full", **model)
    assert got_names == names  # checkpoints stay interchangeable
    assert got == pytest.approx(eager, rel=1e-5)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs: the checkpointed layer broke the graph"
    # a graph cached under another ATEN_CPU_CAPABILITY (or host) is not reused: its ISA is
    # in inductor's cache keys (tests/unit/test_compile_cache_key.py)
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    assert f"{CPU_ISA_TAG}{pick_vec_isa()}" in torch.compiler.config.cache_key_tag.split(";")


# The MoE cases on one MoE layer (the dense layer is the dense model's case); the MoE layer
# compiled alone without recompute is the two-rank "layers pp=2" case (each stage compiles
# its layers), so here it runs under full recompute, where the load counter must count once
@pytest.mark.parametrize(
    ("scope", "model", "recompute"),
    [
        ("layers", {}, None),  # the dense model
        ("layers", ONE_LAYER_MOE, "full"),
        ("model", ONE_LAYER_MOE, "selective"),
    ],
    ids=["layers-dense", "layers-moe-full", "model-moe-selective"],
)
def test_aot_compiled_matches_eager(tmp_path, scope, model, recompute):
    eager, names, eager_module = _eager(tmp_path, **model)
    got, got_names, module = _fit(tmp_path, AOT_EAGER, scope=scope, recompute=recompute, **model)
    assert got_names == names
    assert got == pytest.approx(eager, rel=1e-5)
    if model:
        assert torch.equal(_loads(eager_module), _loads(module))


# -- two ranks ------------------------------------------------------------------------------------

# case -> (scope, MegatronStrategy kwargs or "ddp", model); under ep, validation on 5 samples
# (global batches of 4, micro-batches of 1) leaves rank 0 one sample and rank 1 a padding
# batch: the ranks exchange their expert slot counts, eagerly (micro-batches of 2 would give
# the last batch a shape of its own and recompile every graph for it). One case per mechanism,
# on one MoE layer where the mechanism involves the MoE (a second layer would only repeat its
# collectives; tracing costs seconds per layer and rank); the dense model and per-layer
# compiles of the same collectives are covered on one process above.
TWO_RANK_CASES = {
    # DDP's bucket hooks around a compiled model (the dense model: the MoE adds nothing DDP
    # sees, and its tracing ~3 s of CPU per rank; one layer: a second would add tracing, not
    # another bucket, as the tiny model's gradients fill less than one 25 MiB bucket)
    "model ddp": ("model", "ddp", ONE_LAYER_DENSE),
    # the vocab-parallel embedding and cross-entropy collectives inside the graph, the
    # attention and MLP (the shared expert's) collectives of tensor parallelism, and the MoE's
    # all-gather of whole sequences under sequence parallelism
    "model tp=2 sp": ("model", {"tp": 2, "sequence_parallel": True}, ONE_LAYER_MOE),
    # each stage compiles its own layers; the executor between them stays eager
    "layers pp=2": ("layers", {"pp": 2}, CAPACITY_MOE),
    # the all-to-all of the expert slots inside the compiled MoE layer and, in validation, the
    # slot-count exchange, which breaks the graph. Per layer: both live in the MoE layer; a
    # whole-model graph (the cases above) would add the embedding, head and loss, which have
    # no collectives under ep, and a resume graph per enclosing frame at the break (~7 s of
    # CPU over the two ranks)
    "layers ep=2": ("layers", {"ep": 2}, dict(ONE_LAYER_MOE, val_samples=5, micro_batch_size=1)),
}


def _two_rank_cases(rank: int, world_size: int, root: str) -> dict[str, list[float]]:
    from nanotrain.strategies.megatron import MegatronStrategy

    out = {}
    for i, (name, (scope, layout, model)) in enumerate(TWO_RANK_CASES.items()):
        strategy = nt.DDPStrategy() if layout == "ddp" else MegatronStrategy(**layout)
        out[name] = _fit(Path(root) / str(i), AOT_EAGER, strategy, scope=scope, **model)[0]
        torch._dynamo.reset()  # the next layout traces its own shapes
    # refused at fit start, before any step: compiled layers under split backwards
    try:
        _fit(Path(root) / "zb", AOT_EAGER, MegatronStrategy(pp=2, schedule="zb_1f1b"))
    except ValueError as exc:
        out["zb_1f1b refusal"] = str(exc)
    return out


def _warm_up_compiling() -> None:
    """One tiny aot_eager compile with a backward in this process, before it forks the
    ranks: what dynamo and AOT autograd build once per process on first use (lazy imports,
    decomposition tables) is then inherited by both ranks instead of built in each (measured:
    ~2 s of CPU per rank saved, ~1.4 s spent here). It traces nothing the cases use: each
    case traces its own graphs after `torch._dynamo.reset()`."""
    x = torch.ones(4, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).sum(), backend="aot_eager")(x).backward()
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, list[float]]]:
    root = tmp_path_factory.mktemp("compile_two_ranks")
    _warm_up_compiling()
    return run_world(_two_rank_cases, 2, str(root), timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_two_compiled_ranks_match_eager_single_process(tmp_path, two_ranks, case):
    # the same global batch over 2 ranks: the mean loss per step equals one process's
    eager = _eager(tmp_path, **TWO_RANK_CASES[case][2])[0]
    for ranks_losses in two_ranks:
        assert ranks_losses[case] == pytest.approx(eager, rel=1e-5)


def test_compiled_layers_under_split_backwards_are_refused_at_fit_start(two_ranks):
    for ranks_out in two_ranks:
        assert "schedule='zb_1f1b' splits backwards into an input" in ranks_out["zb_1f1b refusal"]


def test_compile_options_are_checked_before_any_work():
    with pytest.raises(ValueError, match="choose one"):
        nt.LanguageModelModule("tiny", compile_layers=True, compile_model=True)
    with pytest.raises(ValueError, match="compile_model must be True, False or a dict"):
        nt.LanguageModelModule("tiny", compile_model="yes")
    # the pipeline check runs in configure_model, once the strategy's mesh is known
    with pytest.raises(ValueError, match="pp=2 splits it into pipeline stages.*compile_layers"):
        check_compile_options(False, True, pp_size=2)
    check_compile_options(True, False, pp_size=2)  # per-layer compile works with stages
    # a compiled layer's backward runs once: split backwards (zb_1f1b, DualPipeV) cannot use it
    for schedule in ("zb_1f1b", "dualpipev"):
        with pytest.raises(ValueError, match=f"schedule='{schedule}' splits backwards into an"):
            check_compile_options(True, False, pp_size=2, schedule=schedule)
    check_compile_options(True, False, pp_size=2, schedule="1f1b")
    check_compile_options({"backend": "aot_eager"}, False)

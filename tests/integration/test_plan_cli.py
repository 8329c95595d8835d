"""`nanotrain plan` and `nanotrain fit --plan` from the shell."""

from __future__ import annotations

import json

import pytest

from nanotrain.cli import main
from tests.integration.test_cli import SMALL_DEMO

PAPER = [
    "plan",
    "--model",
    "deepseek-v3-671b",
    "--gpus",
    "2048",
    "--gpu",
    "h800",
    "--seq-len",
    "4096",
    "--global-batch-tokens",
    "15M",
    "--pp",
    "16",
    "--ep",
    "64",
    "--zero_stage",
    "1",
    "--pipeline_layout",
    "[4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,1]",
    "--recompute",
    "full",
    "--precision",
    "bf16-mixed",
]  # fmt: skip  (the worked example of docs/planning.md)


def test_plan_json_of_the_deepseek_v3_paper_layout(capsys):
    assert main([*PAPER, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["total_params"] / 1e9) == 671
    assert round(out["active_params_per_token"] / 1e9) == 37
    assert out["layout"] | {"tp": 1, "pp": 16, "dp": 128, "ep": 64} == out["layout"]
    ranks = out["ranks"]
    assert len(ranks) == 16
    # ~15M tokens rounded to whole microbatches on all 128 replicas
    assert abs(out["workload"]["tokens_per_step"] - 15e6) < 128 * 4096
    assert out["workload"]["global_batch_size"] % 128 == 0
    for r in ranks:
        mem = r["memory_bytes"]
        parts = ("params", "grads", "master_weights", "optimizer", "activations", "reserve")
        parts += ("pipeline_held", "pipeline_buffers", "moe_working", "comm_buffers")
        parts += ("fragmentation",)
        assert mem["total"] == sum(mem[k] for k in parts)
    assert out["max_memory_bytes"] == max(r["memory_bytes"]["total"] for r in ranks)
    assert out["fits"] is True and out["step_time_s"] > 0 and 0 < out["mfu"] < 1


def test_plan_table_and_search(capsys):
    assert main(PAPER) == 0
    text = capsys.readouterr().out
    assert "671.03B parameters" in text and "memory per GPU" in text and "fits" in text
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--gpu", "cpu", "--seq-len", "64",
            "--global-batch-size", "16"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "layouts fit" in text and "best layout:" in text


GBS = ["--global-batch-size", "16"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpu", "h900", *GBS], "unknown GPU 'h900'"),
        (["--gpu", '{"name": "x", "memory_bytes": -1}', *GBS], "bad GPU spec"),
        (["--tp", "3", *GBS], "tp=3"),
        (["--ep", "3", *GBS], "ep=3"),
        (["--pp", "4", *GBS], "pp=4 exceeds num_layers=2"),
        (["--global-batch-size", "6", "--dp", "4"], "not a multiple"),
        (["--global-batch-tokens", "lots"], "not a count"),
        (["--global-batch-tokens", "1M", *GBS], "give one of"),
        ([], "give one of"),
        (["--seq-len", "0", *GBS], "seq-len must be >= 1, got 0"),
        (["--micro-batch-size", "0", *GBS], "micro-batch-size must be >= 1, got 0"),
        (["--zero_stage", "4", *GBS], "zero_stage must be 0, 1, 2 or 3"),
        (["--zero_stage", "1", "--cpu_offload", "true", *GBS], "needs --zero_stage 3"),
        (  # the strategy's own refusal, word for word
            ["--pp", "2", "--virtual_pp", "2", "--zero_stage", "3", *GBS]
            + ["--overlap_forward_backward", "true"],
            "zero_stage=3 with overlap_forward_backward=True is not supported: the paired",
        ),
        (["--precision", "bf8", *GBS], "unknown precision 'bf8'"),
        (["--fp8_expert_gemms", "true", *GBS], "fp8_expert_gemms prices one layout"),
        (
            ["--ep", "2", "--fp8_expert_gemms", "true", *GBS],
            "fp8_expert_gemms=True prices the routed experts' GEMMs at the fp8 peak, but "
            "precision 'bf16-mixed' runs its matmuls at bf16",
        ),
        (["--recompute", "some", *GBS], "recompute must be none, light, selective or full"),
        (["--recompute_full_layers", "1", *GBS], "recompute_full_layers prices one layout"),
        (
            ["--pp", "2", "--recompute", "full", "--recompute_full_layers", "1", *GBS],
            "with recompute='full' every layer does already",
        ),
    ],
)
def test_plan_refuses_bad_input_with_a_clear_message(capsys, argv, message):
    base = ["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "64"]
    # later flags win: a bad value replaces the base one
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_fit_prints_the_plan_and_refuses_what_does_not_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOTRAIN_CACHE", str(tmp_path / "cache"))
    import torch.distributed as dist

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was created before the plan was checked")

    fit = ["fit", "--model.init_args.model", "tiny", "--trainer.max_steps", "1",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.loggers", "[]",
           *SMALL_DEMO]  # fmt: skip
    tiny_gpu = ('{"name": "tiny-gpu", "memory_bytes": 1000000, "peak_flops": {"bf16": 1e12}, '
                '"intra_node_bw": 1e9, "inter_node_bw": 1e9}')  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(dist, "init_process_group", no_group)
        assert main([*fit, "--strategy", "megatron", "--plan_gpu", tiny_gpu]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "--ignore_plan" in err
    assert not list(tmp_path.glob("**/checkpoints/*")), "refused before training"
    # the Trainer's precision aliases plan too
    argv = [*fit, "--plan", "--plan_gpu", tiny_gpu, "--ignore_plan", "--trainer.precision", "bf16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "DOES NOT FIT" in out and "precision bf16-mixed" in out


def test_plan_reads_a_transformers_config_json_without_weights_and_takes_overrides(
    tmp_path, capsys
):
    from nanotrain.interop.hf import config_to_hf
    from nanotrain.models import presets

    # DeepSeek-V3's published config.json, as transformers writes it, and nothing else
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(presets.get("deepseek-v3-671b"))))
    runs = {}
    for name, model in (("preset", "deepseek-v3-671b"), ("file", str(tmp_path / "config.json")),
                        ("folder", str(tmp_path))):  # fmt: skip
        assert main([*PAPER[:2], model, *PAPER[3:], "--json"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    for name in ("file", "folder"):
        assert runs[name]["total_params"] == runs["preset"]["total_params"]
        assert runs[name]["step_time_s"] == runs["preset"]["step_time_s"]
    # overrides replace fields: 61 -> 31 layers (a shorter pipeline layout to match)
    args = [*PAPER[:2], str(tmp_path / "config.json"), *PAPER[3:], "--json"]
    at = args.index("--pipeline_layout")
    args[at + 1] = "[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,1]"
    assert main([*args, "--model_overrides", '{"num_layers": 31}']) == 0
    shorter = json.loads(capsys.readouterr().out)
    preset = presets.get("deepseek-v3-671b")
    assert shorter["total_params"] < runs["preset"]["total_params"]
    assert preset.num_layers == 61  # the override did not touch the preset
    # a field the config does not have, and a path with no config: one line each, exit 2
    assert main([*PAPER, "--model_overrides", '{"num_layer": 31}']) == 2
    assert "num_layer" in capsys.readouterr().err
    assert main([*PAPER[:2], str(tmp_path / "missing.json"), *PAPER[3:]]) == 2
    assert "missing.json not found" in capsys.readouterr().err


def test_the_report_names_the_slowest_stage_and_what_bounds_it(capsys):
    # the paper's batch: 15,360 sequences of 4K; the flat dispatch first
    paper = [*PAPER[: PAPER.index("--global-batch-tokens") + 1], "62914560",
             *PAPER[PAPER.index("--global-batch-tokens") + 2 :]]  # fmt: skip
    flat = [*paper, "--node_limited_dispatch", "false"]
    assert main([*flat, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    parts = out["time_parts_s"]
    # stages 1-14 hold four MoE layers each; stage 0 three dense layers and one MoE layer,
    # stage 15 one layer, the MTP block and the head: the expert all-to-all of a four-MoE
    # stage outweighs its compute, so a middle stage sets the pace and ep bounds the step
    # (the middle stages are priced alike; the first of them is named)
    assert out["slowest_stage"] == 1
    assert parts["blocking_comm"] > parts["compute"] > parts["pipeline_bubble"]
    assert out["bottleneck"] == "ep communication"
    assert max(out["slowest_comm_s"], key=out["slowest_comm_s"].get) == "ep"
    ep_bytes = [r["comm_bytes_per_step"]["ep"] for r in out["ranks"]]
    assert ep_bytes[out["slowest_stage"]] == max(ep_bytes) > ep_bytes[0]
    assert main(flat) == 0
    text = capsys.readouterr().out
    slowest = out["slowest_stage"]
    assert f"communication per GPU per step, stage {slowest} (the slowest): " in text
    assert "communication per GPU per step, stage 0 (the largest): " in text
    assert f"bottleneck: ep communication; stage {slowest} sets the pace" in text
    # node-limited (the default: ep=64 spans 8 nodes): the hop between nodes is the largest
    # traffic and, at InfiniBand's measured 45 GB/s against matmuls at 0.75 of peak, bounds
    # the step
    assert main([*paper, "--json"]) == 0
    limited = json.loads(capsys.readouterr().out)
    assert limited["slowest_stage"] == 1 and limited["bottleneck"] == "ep_inter communication"
    comm = limited["slowest_comm_s"]
    assert max(comm, key=comm.get) == "ep_inter"
    assert comm["ep"] + comm["ep_inter"] < out["slowest_comm_s"]["ep"]
    assert limited["step_time_s"] < out["step_time_s"]


def test_traffic_prints_every_group_that_sends_anything():
    from nanotrain.planning.report import _traffic

    assert _traffic({"tp": 0, "ep": 1536, "dp": 3 * 2**30}) == "ep 1.5 KiB, dp 3 GiB"
    assert _traffic({"other": 12}) == "other 12 B"
    assert _traffic({"ep": 1240 * 2**30}) == "ep 1240 GiB"  # no 1.24e+03
    assert _traffic({"tp": 0, "dp": 0}) == "none"


def test_a_layout_that_fits_only_with_fp8_expert_saves_says_so(capsys):
    # the paper's layout with light recomputation on the full batch: about 97 GiB on a
    # middle stage, about 85 with the routed experts' activations in fp8; on an H800 with
    # 90 GiB only the second fits
    paper = [*PAPER[: PAPER.index("--global-batch-tokens") + 1], "62914560",
             *PAPER[PAPER.index("--global-batch-tokens") + 2 :]]  # fmt: skip
    gpu = json.dumps({"name": "h800-90g", "memory_bytes": 90 * 2**30,
                      "peak_flops": {"bf16": 989.4e12, "fp8": 1978.9e12},
                      "intra_node_bw": 2e11, "inter_node_bw": 5e10})  # fmt: skip
    paper[paper.index("--gpu") + 1] = gpu
    light = [*paper[: paper.index("--recompute") + 1], "light", *paper[paper.index("full") + 1 :]]
    assert main([*light, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False
    suggested = [n for n in out["notes"] if "fp8_expert_activations" in n]
    assert len(suggested) == 1 and "it fits" in suggested[0], out["notes"]
    assert main([*light, "--fp8_expert_activations", "true", "--json"]) == 0
    with_fp8 = json.loads(capsys.readouterr().out)
    assert with_fp8["fits"] is True
    assert f"{with_fp8['max_memory_bytes'] / 2**30:.2f} GiB" in suggested[0]
    # no suggestion where fp8 saves would not make it fit either
    none = [*paper[: paper.index("--recompute") + 1], "none", *paper[paper.index("full") + 1 :]]
    assert main([*none, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False
    assert not [n for n in out["notes"] if "fp8_expert_activations" in n]


def test_fp8_expert_gemms_are_priced_with_the_note_that_nanotrain_does_not_run_them(capsys):
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "64", "--ep", "2",
            "--global-batch-size", "16", "--precision", "transformer-engine", "--json"]  # fmt: skip
    assert main(argv) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main([*argv, "--fp8_expert_gemms", "true"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    notes = [n for n in fp8["notes"] if "does not run in nanotrain yet" in n]
    assert len(notes) == 1 and "fp8_expert_gemms" in notes[0]
    assert not [n for n in bf16["notes"] if "does not run in nanotrain yet" in n]
    assert fp8["step_time_s"] < bf16["step_time_s"]

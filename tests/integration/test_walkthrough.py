"""examples/walkthrough.ipynb runs top to bottom, headless, in a temporary folder.

The notebook is executed with nbclient on a kernel of this interpreter (a kernelspec written
into the temporary folder, so nothing has to be installed with `ipykernel install`). Its run
folder is passed through NANOTRAIN_WALKTHROUGH_DIR; HOME and the Jupyter/IPython folders point
into the temporary folder too, so that anything written outside the run folder shows up.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("transformers")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "walkthrough.ipynb"
LOSS_ROW = re.compile(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$")


def _kernelspec(jupyter_dir: Path) -> None:
    """A `python3` kernelspec that starts ipykernel with this very interpreter."""
    spec_dir = jupyter_dir / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_walkthrough_notebook_runs_headless(tmp_path, monkeypatch):
    work, home, jupyter = tmp_path / "work", tmp_path / "home", tmp_path / "jupyter"
    for folder in (work, home):
        folder.mkdir()
    _kernelspec(jupyter)
    run_root = work / "run"
    monkeypatch.setenv("NANOTRAIN_WALKTHROUGH_DIR", str(run_root))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter))  # searched first: our python3 spec wins
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(jupyter / "runtime"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(jupyter / "data"))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(jupyter / "config"))
    monkeypatch.setenv("IPYTHONDIR", str(jupyter / "ipython"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("MPLCONFIGDIR", str(jupyter / "matplotlib"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("NANOTRAIN_CACHE", "HF_HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "the committed notebook must have its outputs cleared"
    )
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,  # per cell; the whole notebook takes well under a minute on 2 cores
        startup_timeout=120,
        resources={"metadata": {"path": str(work)}},
    )
    client.execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    out = "\n".join(_stdout(c) for c in code)

    # 1. the first run: a checkpoint and the run report in its run directory
    run_dir = run_root / "single" / "version_0"
    assert f"run directory: {run_dir}" in out
    ckpt = run_dir / "checkpoints" / "step-00000030"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "meta.json").is_file()
    assert (run_dir / "checkpoints" / "last").read_text().strip() == ckpt.name
    for name in ("report.md", "report.json", "report/loss.png", "metrics.jsonl"):
        assert (run_dir / name).is_file(), name
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "finished" and report["training"]["steps"] == 30
    assert "status:           finished" in out

    # 2. the loss curve was displayed as the report's PNG
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1

    # 3. the two strategies printed the same 30 losses, equal to what each run logged
    rows = [LOSS_ROW.match(line) for line in out.splitlines()]
    losses = {int(m[1]): (float(m[2]), float(m[3])) for m in rows if m}
    assert sorted(losses) == list(range(30))  # steps 1-30 at their logged (0-based) steps
    for single, megatron in losses.values():
        assert megatron == pytest.approx(single, rel=1e-5)
    assert losses[29][0] < losses[0][0] - 1.0  # it learned something
    for column, name in ((0, "single"), (1, "megatron")):
        logged = {}
        for line in (run_root / name / "version_0" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "train/loss" in record:
                logged[record["step"]] = record["train/loss"]
        assert logged == pytest.approx({s: v[column] for s, v in losses.items()}, abs=1e-6)
    assert re.search(r"max relative difference over 30 steps: \d\.\d\de[-+]\d\d", out)

    # 4. the plan of DeepSeek-V3 671B on 2048 H800
    assert "model deepseek-v3-671b: 671.03B parameters" in out
    assert "layout tp1 pp16 dp128 ep64 zero1 full-recompute on 2048 x h800" in out
    assert "fits: True" in out

    # 5. the exported transformers folder, loaded offline; logits and greedy decoding agree
    hf_dir = run_root / "hf-model"
    assert (hf_dir / "config.json").is_file()
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert "DeepseekV3ForCausalLM" in out
    diff = float(re.search(r"max \|logits difference\|: (\S+)", out)[1])
    assert diff < 1e-4
    ours = re.search(r"^nanotrain: +(.+)$", out, re.M)[1]
    theirs = re.search(r"^transformers: +(.+)$", out, re.M)[1]
    assert ours == theirs and ours.startswith("'def __init__(self")

    # nothing was written outside the run folder (HOME stays empty, the working folder holds
    # only the run folder, and transformers' cache folder is never filled)
    assert _files(home) == []
    assert sorted(p.name for p in work.iterdir()) == ["run"]
    assert sorted(p.name for p in run_root.iterdir()) == ["cache", "hf-model", "megatron", "single"]

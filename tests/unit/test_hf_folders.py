"""One loading path for transformers folders: what `import_hf` accepts also loads through
`nanotrain import` (`model_io.import_checkpoint`) and `LanguageModelModule(model=folder)`."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nanotrain import LanguageModelModule  # noqa: E402
from nanotrain.interop.hf_io import import_hf  # noqa: E402
from nanotrain.interop.weights import import_checkpoint, load_pretrained  # noqa: E402
from tests.unit.test_hf_parity import hf_deepseek_config, ids  # noqa: E402


@pytest.fixture
def saved_deepseek(tmp_path):
    """A DeepseekV3ForCausalLM saved by transformers: config.json announces one MTP layer,
    the weights hold none (what save_pretrained writes)."""
    torch.manual_seed(0)
    config = hf_deepseek_config(q_lora_rank=None, n_group=1, topk_group=1)
    config.num_nextn_predict_layers = 1
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(tmp_path / "hf")
    assert (
        json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    )
    return tmp_path / "hf", model


def test_mtp_announced_but_absent_loads_on_every_path(saved_deepseek, tmp_path):
    folder, theirs = saved_deepseek
    with pytest.warns(UserWarning, match="MTP layer"):
        config, model = import_hf(folder)
    with pytest.warns(UserWarning, match="MTP layer") as record:
        loaded_config, weights = load_pretrained(folder)
    assert record[0].filename == __file__  # the warning points at the caller
    assert loaded_config == config and loaded_config.mtp_depth == 0
    assert weights.keys() == model.state_dict().keys()
    # `nanotrain import` writes a weights folder that loads again, warning-free
    with pytest.warns(UserWarning, match="MTP layer"):
        import_checkpoint(folder, tmp_path / "ours")
    assert load_pretrained(tmp_path / "ours")[0] == config
    # LanguageModelModule(model=folder) builds and loads it: the transformers logits
    for source in (folder, tmp_path / "ours"):
        with pytest.warns(UserWarning, match="MTP layer") if source == folder else _no_warning():
            module = LanguageModelModule(model=str(source))
            module.configure_model()
        with torch.no_grad():
            got = module.model.eval()(ids()).logits
            expected = theirs(ids()).logits
        assert (got - expected).abs().max().item() <= 1e-5


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

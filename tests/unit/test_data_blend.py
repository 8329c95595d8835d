"""Blends of prepared corpora: `TokenDataModule(data_path={folder: weight})` serves each corpus
at its weight, deterministically, resumes exactly, and reports each part's validation loss."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.data import TokenDataModule, prepare
from nanotrain.data.blend import (
    BlendedDataset,
    PartsValidationDataset,
    blend_counts,
    blend_index,
    merged_metadata,
    parse_blend,
)
from tests.unit.test_checkpoint import LossRecorder, make_trainer

SEQ = 16


def make_corpora(root):
    """Two prepared corpora (byte tokenizer) in `root`/a and `root`/b, told apart by their
    letters: "a" holds only a-e, "b" only v-z (and newlines)."""
    for name, letters, lines in (("a", "abcde", 40), ("b", "vwxyz", 24)):
        src = root / f"src_{name}"
        src.mkdir()
        for doc in range(2):
            rows = [letters[(doc + i) % 5] * (10 + i % 7) for i in range(lines)]
            (src / f"{doc}.txt").write_text("\n".join(rows) + "\n")
        prepare([src], root / name, val_fraction=0.25)
    return root


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return make_corpora(tmp_path_factory.mktemp("blend"))


def part_of(window: torch.Tensor) -> str:
    """Which corpus a window came from, by its letters."""
    letters = {chr(int(t)) for t in window if chr(int(t)).isalpha()}
    assert letters <= set("abcde") or letters <= set("vwxyz"), letters
    return "a" if letters <= set("abcde") else "b"


def test_weights_are_normalised_and_parts_named_by_folder(tmp_path):
    parts = parse_blend({str(tmp_path / "x" / "web"): 3, str(tmp_path / "code"): 1})
    assert [(name, weight) for name, _, weight in parts] == [("web", 0.75), ("code", 0.25)]
    # two folders of one name: the paths as given name them
    same = parse_blend({"one/data": 1, "two/data": 1})
    assert [name for name, _, _ in same] == ["one/data", "two/data"]


@pytest.mark.parametrize("weight", [0, -0.5, float("nan"), "0.7", True])
def test_a_weight_that_is_not_positive_is_refused(weight):
    with pytest.raises(ValueError, match="weight for 'corpus/a' must be a positive number"):
        parse_blend({"corpus/a": weight, "corpus/b": 0.3})


def test_a_corpus_named_twice_or_none_is_refused():
    with pytest.raises(ValueError, match="names a corpus twice"):
        parse_blend({"corpus/a": 1, "corpus/../corpus/a": 1})
    with pytest.raises(ValueError, match="at least one corpus"):
        TokenDataModule(data_path={})


def test_every_stretch_of_the_blend_holds_each_part_at_its_weight():
    weights = [0.5, 0.3, 0.2]
    counts = blend_counts(weights, 1000)
    assert counts.tolist() == [500, 300, 200]
    assert blend_counts([1 / 3, 1 / 3, 1 / 3], 10).tolist() == [4, 3, 3]
    part, sample = blend_index(counts)
    for k, w in enumerate(weights):
        # each part's samples in order, each once
        assert sample[part == k].tolist() == list(range(counts[k]))
        # any prefix of m positions holds m·w of part k, to within one sample
        seen = np.cumsum(part == k)
        ideal = w * np.arange(1, 1001)
        assert np.abs(seen - ideal).max() <= 1.0, k


def test_a_small_part_is_repeated_and_a_large_one_spread_over_its_length():
    small, large = list(range(100, 103)), list(range(200, 220))
    blend = BlendedDataset([small, large], [0.5, 0.5], num_samples=20)
    items = [blend[i] for i in range(len(blend))]
    assert sorted(i for i in items if i < 200) == sorted(small * 3 + small[:1])  # 10 of 3: cycled
    from_large = [i for i in items if i >= 200]
    assert from_large == list(range(200, 220, 2))  # 10 of 20: every second one
    assert [blend[i] for i in range(20)] == items  # deterministic
    with pytest.raises(IndexError):
        blend[20]


def test_the_datamodule_serves_each_corpus_at_its_weight(corpora):
    blend = {str(corpora / "a"): 0.7, str(corpora / "b"): 0.3}
    data = TokenDataModule(data_path=blend, seq_len=SEQ)
    data.setup("fit")
    ds = data.train_dataset
    windows = [ds[i]["input_ids"] for i in range(len(ds))]
    singles = [TokenDataModule(data_path=str(corpora / n), seq_len=SEQ) for n in "ab"]
    for single in singles:
        single.setup("fit")
    # one pass holds as many windows as both corpora, 70 / 30
    assert len(ds) == sum(len(s.train_dataset) for s in singles)
    counts = collections.Counter(part_of(w) for w in windows)
    assert counts["a"] == round(0.7 * len(ds)) and counts["b"] == len(ds) - counts["a"]
    # every window is a window of its corpus
    known = {
        n: {tuple(s.train_dataset[i]["input_ids"].tolist()) for i in range(len(s.train_dataset))}
        for n, s in zip("ab", singles, strict=True)
    }
    assert all(tuple(w.tolist()) in known[part_of(w)] for w in windows)
    assert data.vocab_size == singles[0].vocab_size
    assert data.part_names == ["a", "b"] and TokenDataModule(data_path=blend).path == corpora / "a"


def test_parts_prepared_with_other_tokenizers_are_refused():
    a = {"tokenizer": "byte", "vocab_size": 257, "max_token_id": 10, "bytes_per_token": 1.0}
    b = dict(a, tokenizer={"kind": "hf", "path": "x/tokenizer.json"}, vocab_size=1000)
    with pytest.raises(ValueError, match="different tokenizers: 'a' with 'byte', 'b' with"):
        merged_metadata([a, b], ["a", "b"])


def test_each_validation_micro_batch_holds_one_part_and_every_prefix_all_parts():
    a = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in range(7)]
    b = [{"input_ids": torch.tensor([9]), "labels": torch.tensor([9])}]
    val = PartsValidationDataset([a, b], pad_to=4)  # micro batch 2 × 2 replicas
    assert len(val) == 12  # a: 2 blocks of 4 (one label-free copy), b: 1 block
    parts = [int(val[i]["part"]) for i in range(12)]
    assert parts == [0] * 4 + [1] * 4 + [0] * 4  # b's block in the middle
    real = [int(val[i]["labels"][0]) for i in range(12) if int(val[i]["labels"][0]) != -100]
    assert sorted(real) == [0, 1, 2, 3, 4, 5, 6, 9]  # every window once; padding has no label
    for rank in range(2):  # rank r reads r, r + 2, ... two at a time
        mine = list(range(rank, 12, 2))
        for start in range(0, len(mine), 2):
            assert len({parts[i] for i in mine[start : start + 2]}) == 1


def _fit(root, data, max_steps, ckpt_path=None, save=False):
    recorder = LossRecorder()
    callbacks = [recorder, ModelCheckpoint()] if save else [recorder]
    trainer = make_trainer(root, max_steps, callbacks, micro_batch_size=4, global_batch_size=8)
    module = nt.LanguageModelModule("tiny-dense", warmup_steps=1, decay_steps=8, lr=3e-3)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return recorder.losses, trainer, module


def test_a_blend_resumes_exactly_and_reports_each_parts_validation_loss(corpora, tmp_path):
    blend = {str(corpora / "a"): 0.7, str(corpora / "b"): 0.3}
    straight, _, _ = _fit(tmp_path / "straight", TokenDataModule(blend, seq_len=SEQ), 4)
    _fit(tmp_path / "split", TokenDataModule(blend, seq_len=SEQ), 2, save=True)
    resumed, trainer, module = _fit(
        tmp_path / "split", TokenDataModule(blend, seq_len=SEQ), 4, ckpt_path="last"
    )
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]  # bit for bit

    # each part's loss is that part validated alone; the blend's is over both parts' tokens
    trainer.settings.limit_val_batches = None
    [blended] = trainer.validate(module, TokenDataModule(blend, seq_len=SEQ), verbose=False)
    alone = {}
    for name in "ab":
        single = TokenDataModule(str(corpora / name), seq_len=SEQ)
        alone[name] = trainer.validate(module, single, verbose=False)[0]["val/loss"]
        single.setup("validate")
        alone[f"n_{name}"] = len(single.val_dataset)
    assert blended["val/loss/a"] == pytest.approx(alone["a"], rel=1e-6)
    assert blended["val/loss/b"] == pytest.approx(alone["b"], rel=1e-6)
    pooled = (alone["a"] * alone["n_a"] + alone["b"] * alone["n_b"]) / (alone["n_a"] + alone["n_b"])
    assert blended["val/loss"] == pytest.approx(pooled, rel=1e-6)
    assert alone["a"] != pytest.approx(alone["b"], rel=1e-3)  # the parts can tell


def test_a_blend_comes_from_yaml_and_from_the_command_line(corpora, tmp_path):
    from nanotrain.cli.commands import run_parser

    a, b = str(corpora / "a"), str(corpora / "b")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"data:\n  class_path: nanotrain.data.TokenDataModule\n  init_args:\n"
        f"    data_path:\n      {a}: 0.7\n      {b}: 0.3\n"
    )
    flag = ["--data.class_path", "nanotrain.data.TokenDataModule"]
    flag += ["--data.init_args.data_path", f'{{"{a}": 0.7, "{b}": 0.3}}']
    for argv in (["--config", str(config)], flag):
        parsed = run_parser("fit").parse_args(argv)
        data = TokenDataModule(**vars(parsed.data.init_args))
        assert [(n, w) for n, _, w in data.blend] == [("a", 0.7), ("b", 0.3)], argv

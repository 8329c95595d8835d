"""The demo corpus and `TokenDataModule`: deterministic files, caching, races, loaders."""

from __future__ import annotations

import sysconfig
import threading
from pathlib import Path

import pytest
import torch

from nanotrain.data import (
    TokenDataModule,
    demo_corpus_files,
    prepare_demo,
    read_metadata,
)

SMALL = 30_000  # bytes of stdlib source: prepares in well under a second


def test_demo_files_are_sorted_stdlib_sources_within_budget():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = demo_corpus_files(SMALL)
    assert files == demo_corpus_files(SMALL)
    relative = [f.relative_to(stdlib).as_posix() for f in files]
    assert relative == sorted(relative)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert 0 < sum(f.stat().st_size for f in files) <= SMALL
    # A larger budget only adds files.
    assert set(files) <= set(demo_corpus_files(4 * SMALL))


def test_demo_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_bytes must be >= 1"):
        demo_corpus_files(0)


def test_prepare_demo_tokenizes_exactly_the_demo_files(tmp_path):
    out = prepare_demo(tmp_path / "demo", max_bytes=SMALL)
    meta = read_metadata(out)
    files = demo_corpus_files(SMALL)
    expected_tokens = sum(f.stat().st_size + 1 for f in files)  # bytes + one EOS per file
    assert meta["total_tokens"] == expected_tokens and meta["num_documents"] == len(files)
    assert meta["splits"]["val"]["tokens"] > 0


def test_prepare_demo_reuses_a_matching_cache_and_rebuilds_a_different_one(tmp_path):
    out = prepare_demo(tmp_path / "demo", max_bytes=SMALL)
    meta_file = out / "metadata.json"
    before = meta_file.stat().st_mtime_ns, meta_file.stat().st_ino
    assert prepare_demo(tmp_path / "demo", max_bytes=SMALL) == out
    assert (meta_file.stat().st_mtime_ns, meta_file.stat().st_ino) == before
    prepare_demo(tmp_path / "demo", max_bytes=2 * SMALL)
    assert read_metadata(out)["num_files"] == len(demo_corpus_files(2 * SMALL))


def test_concurrent_prepare_demo_calls_leave_one_valid_corpus(tmp_path):
    errors: list[BaseException] = []

    def run() -> None:
        try:
            prepare_demo(tmp_path / "demo", max_bytes=SMALL)
        except BaseException as err:  # surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert read_metadata(tmp_path / "demo")["total_tokens"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no temp folders left behind


# -- TokenDataModule ----------------------------------------------------------------------------


@pytest.fixture
def demo_module(tmp_path, monkeypatch) -> TokenDataModule:
    monkeypatch.setenv("NANOTRAIN_CACHE", str(tmp_path / "cache"))
    return TokenDataModule(seq_len=32, micro_batch_size=4, demo_max_bytes=SMALL)


def test_datamodule_prepares_the_demo_into_the_cache(demo_module, tmp_path):
    demo_module.prepare_data()
    assert demo_module.path == tmp_path / "cache" / f"demo-byte-{SMALL}"
    assert (demo_module.path / "metadata.json").is_file()
    assert demo_module.vocab_size == 257 and demo_module.tokenizer.eos_id == 256


def test_datamodule_loaders_give_shifted_token_batches(demo_module):
    demo_module.setup("fit")
    batch = next(iter(demo_module.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
    assert batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    val = list(demo_module.val_dataloader())
    val_stream = demo_module.val_dataset.tokens(0, demo_module.val_dataset.num_tokens)
    assert torch.equal(val[0]["input_ids"][0], torch.from_numpy(val_stream[:32]))
    assert sum(len(b["input_ids"]) for b in val) == len(demo_module.val_dataset)


def test_bytes_per_token_is_val_text_bytes_over_val_tokens(demo_module):
    demo_module.setup("validate")
    tokens = demo_module.val_dataset.tokens(0, demo_module.val_dataset.num_tokens)
    text_bytes = int((tokens != 256).sum())  # byte tokenizer: every non-EOS token is a byte
    assert demo_module.bytes_per_token == pytest.approx(text_bytes / len(tokens))


def test_datamodule_reads_a_prepared_folder_and_its_tokenizer(tmp_path):
    from nanotrain.data import prepare, train_bpe

    text = "alpha beta gamma delta\n" * 200
    train_bpe([text], vocab_size=270, out_path=tmp_path / "tok.json")
    (tmp_path / "in.txt").write_text(text)
    out = prepare([str(tmp_path / "in.txt")], tmp_path / "o", tokenizer=str(tmp_path / "tok.json"))
    dm = TokenDataModule(data_path=str(out), seq_len=8, micro_batch_size=2)
    dm.setup("fit")
    assert dm.vocab_size == read_metadata(out)["vocab_size"]
    ids = dm.train_dataset[0]["input_ids"].tolist()
    assert dm.tokenizer.decode(ids) in text
    with pytest.raises(ValueError, match="model's vocab_size is 100"):
        dm.validate_vocab(100)


def test_datamodule_without_val_tokens_has_no_val_loader(tmp_path):
    from nanotrain.data import prepare

    (tmp_path / "in.txt").write_text("x" * 500)
    out = prepare([str(tmp_path / "in.txt")], tmp_path / "o", val_fraction=0)
    dm = TokenDataModule(data_path=str(out), seq_len=8)
    dm.setup("fit")
    assert dm.val_dataloader() is None and len(dm.train_dataset) == 500 // 8


def test_datamodule_missing_path_and_bad_args_are_clear(tmp_path):
    with pytest.raises(ValueError, match="nope' does not exist; run `nanotrain prepare"):
        TokenDataModule(data_path=str(tmp_path / "nope")).prepare_data()
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        TokenDataModule(seq_len=0)


def test_datamodule_works_under_lightning_trainer(demo_module, tmp_path):
    import lightning.pytorch as pl

    class Bigram(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(257, 257)

        def training_step(self, batch, batch_idx):
            logits = self.emb(batch["input_ids"])  # (B, T, V)
            return torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"].flatten()
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Bigram(), datamodule=demo_module)
    assert trainer.global_step == 2

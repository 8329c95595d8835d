"""Document boundaries in packed windows: each document of a window gives the logits, losses
and MTP losses it gives run alone from position 0, on every attention and rotary path; the
option from LanguageModelModule and its errors."""

import pytest
import torch

from nanotrain import LanguageModelModule
from nanotrain.models import build_model, presets
from nanotrain.models.documents import DocumentMask, set_document_mask
from nanotrain.models.transformer import set_recompute

V, EOD = 257, 256
# three documents, the last cut by the window's end: 7 and 5 tokens with their EOD, then 4
DOC_LENGTHS = (6, 4, 4)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _documents(seed=0):
    """Each document's tokens (ends with EOD except the last) and the packed window [2, T]
    (the second row the same documents in the other order, so the batch's rows differ)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, EOD, (n,), generator=g) for n in DOC_LENGTHS]
    docs = [torch.cat((d, torch.tensor([EOD]))) for d in docs[:-1]] + [docs[-1]]
    rows = [torch.cat(docs), torch.cat((docs[1], docs[0], docs[2]))]
    return docs, torch.stack(rows)


# name -> model overrides: MLA on the hand-written CPU path (v_dim != qk dim), MLA on SDPA
# with a mask (equal widths), rotate-half rope for MLA, dense GQA and dense MHA on SDPA
CASES = {
    "mla-reference": ("tiny", {}),
    "mla-sdpa": ("tiny", {"v_head_dim": 24}),
    "mla-rotate-half": ("tiny", {"rope_interleave": False}),
    "dense-gqa": ("tiny-dense", {}),
    "dense-mha": ("tiny-dense", {"num_kv_heads": 4}),
}


def _model(case, mask_loss=False):
    name, overrides = CASES[case]
    torch.manual_seed(0)
    model = build_model(presets.get(name, **overrides))
    set_document_mask(model, DocumentMask(EOD, mask_loss=mask_loss))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_each_document_in_a_window_gives_its_logits_alone(case):
    model = _model(case).eval()
    docs, window = _documents()
    with torch.no_grad():
        packed = model(window).logits  # (2, T, V)
        alone = [model(d[None]).logits[0] for d in docs]
    order = [[0, 1, 2], [1, 0, 2]]
    for row, indices in enumerate(order):
        start = 0
        for i in indices:
            n = len(docs[i])
            torch.testing.assert_close(
                packed[row, start : start + n], alone[i], rtol=1e-5, atol=1e-5
            )
            start += n
    # the mask changes something: without it, the second document sees the first
    set_document_mask(model, None)
    with torch.no_grad():
        plain = model(window).logits
    assert not torch.allclose(plain[0, 7:12], alone[1], atol=1e-3)


def _labels(window):
    labels = torch.full_like(window, -100)
    labels[:, :-1] = window[:, 1:]
    return labels


def test_eod_mask_loss_ignores_the_label_after_each_document():
    docs, window = _documents()
    labels = _labels(window)
    masked = DocumentMask(EOD, mask_loss=True).labels(window, labels)
    expected = labels.clone()
    expected[window == EOD] = -100
    assert torch.equal(masked, expected)
    assert torch.equal(DocumentMask(EOD).labels(window, labels), labels)  # off: unchanged
    # MTP depth 2 at t predicts t + 3: ignored where an EOD lies in t .. t + 2
    targets = DocumentMask(EOD, mask_loss=True).mtp_targets(window, labels, 2)
    row = window[0].tolist()
    for t in range(len(row)):
        crosses = EOD in row[t : t + 3]
        beyond = t + 3 >= len(row)
        want = -100 if crosses or beyond else row[t + 3]
        assert targets[0, t].item() == want, t


def test_losses_and_mtp_losses_equal_each_document_alone():
    # with eod_mask_loss every target of a packed document is one it has alone (no target
    # past its EOD), so the window's mean losses are the documents' means weighed by counts
    torch.manual_seed(0)
    model = build_model(presets.get("tiny", mtp_depth=2, aux_loss_alpha=0.0)).train()
    set_document_mask(model, DocumentMask(EOD, mask_loss=True))
    docs, window = _documents()
    window = window[:1]
    out = model(window, _labels(window))
    lm_sum = mtp_sum = 0.0
    lm_n, mtp_n = 0, torch.zeros(2)
    for d in docs:
        alone = model(d[None], _labels(d[None]))
        n = alone.num_tokens.item()
        lm_sum, lm_n = lm_sum + alone.loss * n, lm_n + n
        # depth k's targets alone: positions t with t + k + 1 inside the document
        counts = torch.tensor([max(len(d) - 1 - k, 0) for k in (1, 2)], dtype=torch.float32)
        mtp_sum, mtp_n = mtp_sum + alone.mtp_losses.detach() * counts, mtp_n + counts
    torch.testing.assert_close(out.loss, lm_sum / lm_n, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.mtp_losses.detach(), mtp_sum / mtp_n, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective", "light"])
def test_recompute_modes_give_the_same_gradients_under_the_mask(mode):
    docs, window = _documents()
    labels = _labels(window)
    grads = []
    for recompute in (None, mode):
        model = _model("mla-reference", mask_loss=True).train()
        set_recompute(model, recompute)
        model(window, labels).total_loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Data:
    seq_len, vocab_size = 16, V
    metadata = {"eos_id": EOD, "vocab_size": V}


def _configured(data, **kwargs):
    module = LanguageModelModule("tiny", **kwargs)
    module._datamodule = lambda: data
    module.configure_model()
    return module


def test_module_takes_the_data_eos_and_counts_masked_labels():
    module = _configured(_Data(), document_mask=True, eod_mask_loss=True)
    assert module.documents == DocumentMask(EOD, mask_loss=True, mask_attention=True)
    assert module.model.documents is module.documents
    _, window = _documents()
    batch = {"input_ids": window, "labels": _labels(window)}
    eods_with_label = int((window[:, :-1] == EOD).sum())
    assert module.count_tokens(batch).item() == window.numel() - 2 - eods_with_label
    out = module(window, batch["labels"])
    assert out.num_tokens.item() == module.count_tokens(batch).item()
    # off by default: the model attends across documents
    assert _configured(_Data()).model.documents is None


def test_module_refuses_a_missing_or_out_of_vocab_eod():
    class NoEos:
        seq_len, vocab_size, metadata = 16, V, {}

    with pytest.raises(ValueError, match="eod_token_id"):
        _configured(NoEos(), document_mask=True)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        _configured(NoEos(), document_mask=True, eod_token_id=V)
    with pytest.raises(ValueError, match="eod_token_id must be >= 0"):
        LanguageModelModule("tiny", document_mask=True, eod_token_id=-1)
    with pytest.raises(TypeError, match="document_mask"):
        LanguageModelModule("tiny", document_mask="yes")


def test_the_options_parse_from_the_command_line(capsys):
    from pathlib import Path

    from nanotrain.cli import main

    config = Path(__file__).resolve().parents[2] / "examples/configs/tiny_deepseek.yaml"
    flags = ["--model.init_args.document_mask", "true", "--model.init_args.eod_mask_loss", "true"]
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(config), *flags, "--print_config"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert "document_mask: true" in printed and "eod_mask_loss: true" in printed

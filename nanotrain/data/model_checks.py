"""What a model's setup reads off the data it will train on (any data module, read by
duck typing): whether the data fits the model (window length, token ids), and the
end-of-document id the data's tokenizer appends."""

from __future__ import annotations

from typing import Any

from nanotrain.data.dataset import check_vocab


def check_data_fits_model(data: Any, config: Any) -> None:
    """Before the model is built: the data's windows fit the model's `max_seq_len` and its
    token ids (prepared data's `max_token_id`) lie below the model's vocab_size.

    Raises:
        ValueError: either does not hold, with the setting that fixes it.
    """
    seq_len = getattr(data, "seq_len", None)
    max_seq_len = getattr(config, "max_seq_len", None)
    if seq_len is not None and max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(
            f"the data's seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}; "
            f"shorten --data.init_args.seq_len, or extend the RoPE tables explicitly with "
            f"--model.init_args.model_overrides '{{max_seq_len: {seq_len}}}'"
        )
    metadata = getattr(data, "metadata", None)
    if isinstance(metadata, dict) and "max_token_id" in metadata:
        check_vocab(metadata, config.vocab_size)


def data_eod_id(data: Any) -> int | None:
    """The end-of-document id the data's tokenizer appends after each document, or None
    (a data module with ``eos_id``, ``metadata["eos_id"]`` or a ``tokenizer.eos_id``)."""
    if data is None:
        return None
    eod = getattr(data, "eos_id", None)
    if eod is None:
        metadata = getattr(data, "metadata", None)
        if isinstance(metadata, dict):
            eod = metadata.get("eos_id")
    if eod is None:
        eod = getattr(getattr(data, "tokenizer", None), "eos_id", None)
    return None if eod is None else int(eod)

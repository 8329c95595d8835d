"""Fine-tune a transformers model on your own text and hand it back to transformers.

    python examples/finetune_hf.py --hf path/to/llama_or_deepseek_v3 --text my_texts/ --work out/

1. `nanotrain prepare` turns the text folder into token shards (with the model's own
   tokenizer.json when the folder has one, else the byte tokenizer);
2. the Trainer fine-tunes the model loaded from the transformers folder (Llama or
   DeepSeek-V3 families; any strategy and layout: each rank loads only its slice);
3. `nanotrain export --to hf` writes the last checkpoint as a transformers folder that
   `AutoModelForCausalLM.from_pretrained(<work>/hf)` loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nanotrain as nt
from nanotrain.callbacks import LearningRateMonitor, ModelCheckpoint, RunReport
from nanotrain.cli import main as nanotrain_cli


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="fine-tune a transformers model on a text folder")
    parser.add_argument(
        "--hf", required=True, help="transformers folder (config.json + safetensors)"
    )
    parser.add_argument("--text", required=True, help="folder (or glob) of .txt / .jsonl files")
    parser.add_argument("--work", required=True, help="where data, runs and the export go")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    work = Path(args.work)

    tokenizer = Path(args.hf) / "tokenizer.json"
    data_dir = work / "data"
    nanotrain_cli(
        ["prepare", "--inputs", args.text, "--out", str(data_dir), "--val_fraction", "0.1"]
        + ["--tokenizer", str(tokenizer) if tokenizer.is_file() else "byte"]
    )

    trainer = nt.Trainer(
        max_steps=args.max_steps,
        global_batch_size=8,
        micro_batch_size=4,
        val_check_interval=max(1, args.max_steps // 4),
        validate_at_start=True,
        log_every_n_steps=max(1, min(10, args.max_steps)),
        default_root_dir=str(work / "runs"),
        name="finetune",
        callbacks=[
            checkpoint := ModelCheckpoint(save_last=True),
            LearningRateMonitor(),
            RunReport(),
        ],
    )
    model = nt.LanguageModelModule(
        model=args.hf, lr=args.lr, min_lr=args.lr / 10, warmup_steps=max(1, args.max_steps // 10)
    )
    trainer.fit(model, nt.data.TokenDataModule(data_path=str(data_dir), seq_len=args.seq_len))

    out = work / "hf"
    nanotrain_cli(["export", "--to", "hf", "--ckpt", checkpoint.last_model_path, "--out", str(out)])
    return out


if __name__ == "__main__":
    main()

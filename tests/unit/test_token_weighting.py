"""A step's loss is the mean over every loss-bearing token of the global batch, not the mean
of microbatch means: microbatches with more ignored labels count less."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import nanotrain as nt

VOCAB, SEQ, HIDDEN = 11, 6, 8


class MaskedTokens(Dataset):
    """Random next-token items whose labels are ignored (-100) on a per-sample number of
    positions: sample i keeps ``1 + i % SEQ`` labels, so microbatches differ in tokens."""

    def __init__(self, n: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        labels[1 + i % SEQ :] = -100
        return {"input_ids": self.ids[i, :-1], "labels": labels}


class TinyLM(nt.NanoModule):
    """Embedding -> linear head; mean cross-entropy over the microbatch's kept labels."""

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def count_tokens(self, batch) -> int:
        return int((batch["labels"] != -100).sum())


class Capture(nt.Callback):
    """The first step's loss, token count and gradients."""

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.grads = {n: p.grad.clone() for n, p in module.named_parameters()}

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.loss, self.tokens = float(outputs.loss), outputs.num_tokens


def test_accumulated_step_equals_one_pass_over_all_tokens_of_the_global_batch(tmp_path):
    module, capture = TinyLM(), Capture()
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_steps=1,
        global_batch_size=8,
        micro_batch_size=2,  # 4 microbatches of 2 samples keeping 1 to 6 labels each
        callbacks=[capture],
        default_root_dir=str(tmp_path),
        loggers=[],
        seed=0,
    )
    data = MaskedTokens()
    trainer.fit(module, train_dataloaders=data)

    # reference: the same initial weights, one forward over the whole batch
    reference = TinyLM()
    reference.configure_model()
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "labels")}
    loss_tensor = reference.training_step(batch, 0)
    loss_tensor.backward()
    loss = float(loss_tensor.detach())
    kept = int((batch["labels"] != -100).sum())
    assert capture.tokens == kept == (1 + 2 + 3 + 4 + 5 + 6) + (1 + 2)
    assert abs(capture.loss - loss) <= 1e-6 * loss
    # the mean of microbatch means differs by far more than the tolerance on this data
    with torch.no_grad():
        micro_means = [
            float(reference.training_step({k: v[i : i + 2] for k, v in batch.items()}, 0))
            for i in range(0, 8, 2)
        ]
    assert abs(sum(micro_means) / 4 - loss) > 1e-3
    for name, p in reference.named_parameters():
        torch.testing.assert_close(capture.grads[name], p.grad, rtol=1e-5, atol=1e-7)

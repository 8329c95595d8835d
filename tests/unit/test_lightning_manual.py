"""Lightning's manual optimization (`automatic_optimization = False`) under nanotrain.Trainer
gives lightning.Trainer's result: one optimizer with a scheduler and manual clipping, and a
GAN with two optimizers, `toggle_optimizer` and two schedulers, run under both Trainers with
the same data; weights, global_step, learning rates, hook calls and logged values are
compared. What cannot run it is refused at fit start with the reason."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt


def data(n: int = 32) -> TensorDataset:
    """Regression data: y = x · w + noise-free, 4 features."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


class ManualRegression(pl.LightningModule):
    """One optimizer stepped by hand every batch, its scheduler every 2 batches, the
    gradients clipped by norm; records the hooks that run."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lin = nn.Linear(4, 1)
        self.calls: list[str] = []

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = F.mse_loss(self.lin(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        if (batch_idx + 1) % 2 == 0:
            sched.step()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_before_backward(self, loss):
        self.calls.append("on_before_backward")

    def on_after_backward(self):
        self.calls.append("on_after_backward")

    def on_before_optimizer_step(self, optimizer):
        self.calls.append(f"on_before_optimizer_step:{type(optimizer).__name__}")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(f"on_train_batch_end:{sorted(outputs)}")

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class TinyGAN(pl.LightningModule):
    """A generator and a discriminator, each with its optimizer and scheduler, trained
    alternately with toggle_optimizer as Lightning's GAN example does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.steps_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        noise = real[:, :2] * 0.5  # per sample: the same under any split of the batch
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        self.toggle_optimizer(opt_g)
        fake = self.generator(noise)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_real = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_fake = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        d_loss = (d_real + d_fake) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.steps_seen.append(self.global_step)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def on_train_epoch_end(self):
        for sched in self.lr_schedulers():
            sched.step()

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=0.05)
        scheds = [
            torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (opt_g, opt_d)
        ]
        return [opt_g, opt_d], scheds


def fit_both(module: pl.LightningModule, tmp_path, **args):
    """Fit a copy of `module` under each Trainer; return [(module, trainer)] for both."""
    runs = []
    for kind in ("lightning", "nanotrain"):
        copy_of = copy.deepcopy(module)
        common = dict(
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            default_root_dir=str(tmp_path / kind), **args,
        )  # fmt: skip
        if kind == "lightning":
            trainer = pl.Trainer(accelerator="cpu", devices=1, enable_model_summary=False,
                                 num_sanity_val_steps=0, **common)  # fmt: skip
        else:
            trainer = nt.Trainer(enable_monitors=False, **common)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(copy_of, DataLoader(data(), batch_size=8))
        runs.append((copy_of, trainer))
    return runs


def assert_same_run(lightning_run, nanotrain_run) -> None:
    (a, ta), (b, tb) = lightning_run, nanotrain_run
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)
    assert tb.global_step == ta.global_step
    lr = [g["lr"] for o in ta.optimizers for g in o.param_groups]
    assert [g["lr"] for o in tb.optimizers for g in o.param_groups] == pytest.approx(lr)
    for key, value in ta.callback_metrics.items():
        torch.testing.assert_close(tb.callback_metrics[key], value, rtol=0, atol=1e-6)


def test_manual_optimization_with_one_optimizer_equals_lightnings(tmp_path):
    lightning_run, nanotrain_run = fit_both(ManualRegression(), tmp_path, max_epochs=2)
    assert_same_run(lightning_run, nanotrain_run)
    assert nanotrain_run[0].calls == lightning_run[0].calls


def test_a_gan_with_two_optimizers_and_toggling_equals_lightnings(tmp_path):
    # max_steps counts optimizer steps (two per batch), as in Lightning
    lightning_run, nanotrain_run = fit_both(TinyGAN(), tmp_path, max_steps=14)
    assert_same_run(lightning_run, nanotrain_run)
    assert nanotrain_run[0].steps_seen == lightning_run[0].steps_seen
    assert all(p.requires_grad for p in nanotrain_run[0].parameters())  # untoggled


@pytest.mark.parametrize(
    "args,message",
    [
        ({"accumulate_grad_batches": 2}, "automatic gradient accumulation is not supported"),
        ({"gradient_clip_val": 1.0}, "automatic gradient clipping is not supported"),
        ({"precision": "16-mixed"}, "manual optimization runs under 32-true or bf16-mixed"),
    ],
)
def test_what_cannot_run_manual_optimization_is_refused_at_fit_start(tmp_path, args, message):
    trainer = nt.Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, **args)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=message):
            trainer.fit(ManualRegression(), DataLoader(data(), batch_size=8))


def test_a_manual_gan_resumes_exactly_from_its_checkpoint(tmp_path):
    def run(root, ckpt_path=None):
        torch.manual_seed(0)
        module = TinyGAN()
        trainer = nt.Trainer(
            max_steps=12, default_root_dir=str(tmp_path / root), enable_progress_bar=False,
            enable_monitors=False, logger=False,
            callbacks=[nt.callbacks.ModelCheckpoint(every_n_steps=4, save_top_k=-1)],
        )  # fmt: skip
        trainer.fit(module, DataLoader(data(), batch_size=8), ckpt_path=ckpt_path)
        return module, trainer

    whole, trainer = run("whole")
    resumed, _ = run("resumed", str(trainer.checkpoint_dir / "step-00000004"))
    for (name, x), y in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    assert [s.last_epoch for s in resumed.lr_schedulers()] == [2, 2]

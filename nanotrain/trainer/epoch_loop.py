"""The loop over epochs and their optimizer steps: when it stops, when an epoch starts and
ends (sampler epoch, Lightning's RNG draw, epoch-end validation and hooks, epoch-interval
schedulers), and when the dataloaders are built again."""

from __future__ import annotations

from nanotrain.trainer.evaluation import finish_epoch
from nanotrain.trainer.loaders import draw_as_lightning
from nanotrain.trainer.manual import manual_step
from nanotrain.trainer.preemption import stop_if_preempted


class EpochLoopMethods:
    """Mixin of `nanotrain.Trainer`: the training loop `fit` runs, and its stopping rule."""

    def _done(self) -> bool:
        s, st = self.settings, self.state
        return (
            self.should_stop
            or (s.max_steps is not None and st.global_step >= s.max_steps)
            or (s.max_tokens is not None and st.consumed_tokens >= s.max_tokens)
            or (s.max_epochs is not None and st.epoch >= s.max_epochs)
        )

    def _train_loop(self) -> None:
        st = self.state
        if st.steps_per_epoch == 0:
            raise ValueError("the training data does not fill one global batch")
        while not self._done():
            if st.steps_in_epoch == 0:
                self._reload_if_due()
            if st.steps_in_epoch < st.steps_per_epoch:
                if st.steps_in_epoch == 0:
                    self._train_sampler.set_epoch(st.epoch)
                self._call("on_train_epoch_start")
                if st.steps_in_epoch == 0:  # a resumed epoch made its draw before the save
                    draw_as_lightning(self._train_loader)
                batches = iter(self._train_loader)
                ran_out = False  # a stream (IterableDataset) ended: so does its epoch
                while st.steps_in_epoch < st.steps_per_epoch and not self._done():
                    try:
                        micro = [
                            self.strategy.batch_to_device(next(batches))
                            for _ in range(self.num_microbatches)
                        ]
                    except StopIteration:
                        ran_out = True
                        self._step_scheduler("epoch", st.epoch)  # as Lightning: at its end
                        break
                    if self._manual:  # the module steps its optimizers itself
                        manual_step(self, micro[0])
                    else:
                        self._train_step(micro)
                    stop_if_preempted(self, self._preemption)
                if st.steps_in_epoch < st.steps_per_epoch and not ran_out:
                    break  # stopped mid-epoch
            else:  # resumed at an epoch's end, which runs again: its records are its last step's
                self._step_taken = True
            n_val = self.settings.check_val_every_n_epoch
            # as Lightning: an int val_check_interval replaces the epoch-end validation
            at_epoch_end = n_val and self.settings.val_check_interval is None
            if self._val_loader is not None and at_epoch_end and (st.epoch + 1) % n_val == 0:
                if self._last_val_step != st.global_step:  # as Lightning: before the hook
                    self._run_validation()
            finish_epoch(self, "on_train_epoch_end")
            self._step_scheduler("epoch", st.epoch, plateau=True)  # as Lightning: after the hooks
            st.epoch += 1
            st.steps_in_epoch = 0
            self._step_taken = False  # the next epoch starts: see `logged_step`

    def _reload_if_due(self) -> None:
        """As Lightning's `reload_dataloaders_every_n_epochs`: at the start of every n-th
        epoch since the last build, ask the sources for the training and validation
        DataLoaders again (the module's or datamodule's `*_dataloader()`)."""
        every = self.settings.reload_dataloaders_every_n_epochs
        if every and self.state.epoch - self._last_reload_epoch >= every:
            self._build_loaders("fit", *self._fit_sources)
            self._last_reload_epoch = self.state.epoch

"""Forward-only steps of `MegatronStrategy` (a mixin): validation and test through the
pipeline stages, the ZeRO-3 model or the plain module; prediction, refused where no rank holds
whole sequences or the whole model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanotrain.parallel.context import context_batch

if TYPE_CHECKING:
    from nanotrain.module import NanoModule


class MegatronEvaluation:
    """Mixin of `MegatronStrategy` (before `Strategy` in its bases: `super()` is Strategy's
    plain forward-only step)."""

    def validation_step(
        self, module: NanoModule, batch: Any, batch_idx: int, step_name: str = "validation_step"
    ) -> Any:
        """Forward only: through the pipeline stages under pp > 1 (every stage logs the
        global values), else `module.<step_name>` ("validation_step" or "test_step").
        Under context parallelism each rank runs its chunks of the whole sequences, and the
        logged means reduce over the dp x cp ranks (`metric_process_group`)."""
        if self.cp > 1:
            batch = context_batch(batch, self.mesh.cp_group)
        if self._pipeline is not None:
            run = None if self._fsdp is None else self._fsdp.run
            return self._pipeline.validation_step(
                module, batch, batch_idx, self.precision, step_name, run=run
            )
        if self._fsdp is not None:
            with torch.no_grad(), self.precision.forward_context():
                return self._fsdp.run(getattr(module, step_name), batch, batch_idx)
        return super().validation_step(module, batch, batch_idx, step_name)

    def predict_step(self, module: NanoModule, batch: Any, batch_idx: int) -> Any:
        """`module.predict_step` forward-only; refused under pp > 1, where no stage holds a
        whole model to return predictions from."""
        if self.cp > 1:
            raise ValueError(
                "Trainer.predict is not supported under context parallelism (cp > 1): each "
                "rank holds only chunks of the sequences; predict with cp=1"
            )
        if self._pipeline is not None:
            raise ValueError(
                "Trainer.predict is not supported under pipeline parallelism (pp > 1): no "
                "stage holds the whole model; predict with pp=1 (tp/ep/dp are fine), or export "
                "the checkpoint with `nanotrain export` and predict from that"
            )
        if self._fsdp is not None:
            with torch.no_grad(), self.precision.forward_context():
                return self._fsdp.run(module.predict_step, batch, batch_idx)
        return super().predict_step(module, batch, batch_idx)

    def generation_refusal(self) -> str | None:
        """Under pp > 1 each rank holds some of the layers, under cp > 1 each rank's model
        runs chunks of every sequence: neither runs a whole-sequence `generate`."""
        if self.pp > 1:
            return "pipeline parallelism (pp > 1) splits the model's layers over ranks"
        if self.cp > 1:
            return "context parallelism (cp > 1) splits every sequence over ranks"
        return None

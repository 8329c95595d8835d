"""A rank that is alive but stalls (never joins the next collective) ends the job within the
strategy's timeout, with an error naming the collective and the process group."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

import nanotrain as nt
from nanotrain.runtime.collective_errors import CollectiveTimeoutError
from nanotrain.testing import BlobsData, Classifier
from tests.distributed.spawn import run_world
from tests.unit.test_language_model import RandomTokens

pytestmark = pytest.mark.distributed


class StallAt(nt.Callback):
    """Rank 1 stays out of step `step` (alive, but not in the collective) until `released` is
    set, at most `seconds`."""

    def __init__(self, step: int, released, seconds: float) -> None:
        self.step, self.released, self.seconds = step, released, seconds

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.step and trainer.global_rank == 1:
            self.released.wait(self.seconds)


def _stall(rank: int, world_size: int, kind: str, waited) -> dict:
    # rank 1 stalls until rank 0's collective has given up (`waited`), not a fixed time: rank 0
    # sees a peer absent for its whole timeout however slow the machine, and neither rank
    # idles after that (a fixed 5 s stall made each case last 5 s; the 30 s cap is for a run
    # in which rank 0 never times out, which the test then reports)
    stall = StallAt(2, waited, 30.0)
    settings = dict(max_steps=4, loggers=[], seed=0, callbacks=[stall])
    if kind == "ddp":
        trainer = nt.Trainer(
            strategy=nt.DDPStrategy(timeout_s=2),
            micro_batch_size=4,
            global_batch_size=8,
            **settings,
        )
        fit = lambda: trainer.fit(Classifier(), BlobsData(batch_size=4))  # noqa: E731
    else:
        strategy = nt.MegatronStrategy(tp=2, timeout_s=2)
        trainer = nt.Trainer(strategy=strategy, micro_batch_size=2, global_batch_size=2, **settings)
        module = nt.LanguageModelModule(model="tiny", vocab_size=257)
        fit = lambda: trainer.fit(module, train_dataloaders=RandomTokens(8, 257))  # noqa: E731
    start = time.monotonic()
    try:
        fit()
        return {"error": None}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "error": str(exc), "seconds": time.monotonic() - start}
    finally:
        if rank == 0:
            waited.set()


@pytest.mark.parametrize(
    ("kind", "group"),
    [("ddp", "the default process group (all 2 ranks)"), ("megatron", "process group tp")],
)
def test_a_stalled_rank_ends_the_job_with_the_collective_and_group_named(tmp_path, kind, group):
    torch.manual_seed(0)
    waited = mp.get_context("fork").Event()  # the ranks are forked: they share it
    waiting = run_world(_stall, 2, kind, waited, timeout=60, pg_timeout=2)[0]
    assert waiting["type"] == CollectiveTimeoutError.__name__, waiting
    assert f"collective all_reduce over {group}" in waiting["error"]
    assert "timed out after 2 s (the strategy's timeout_s)" in waiting["error"]
    assert waiting["seconds"] < 20


def _planted_pipeline_deadlock(rank: int, world_size: int) -> dict:
    """pp=2 where stage 0 sends microbatch 0's activation under microbatch 1's tag (a bug a
    schedule could have): stage 1 waits for a message that never comes."""
    from nanotrain.parallel.pipeline import PipelineComm

    strategy = nt.MegatronStrategy(pp=2)  # no timeout given: the test world's (2 s)
    real = PipelineComm.send_forward
    PipelineComm.send_forward = lambda self, m, c, out: real(self, m + 1, c, out)
    trainer = nt.Trainer(strategy=strategy, max_steps=1, micro_batch_size=2, global_batch_size=4,
                         loggers=[], enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    start = time.monotonic()
    try:
        module = nt.LanguageModelModule("tiny", vocab_size=257)
        trainer.fit(module, train_dataloaders=RandomTokens(8, 257))
        return {"error": None, "timeout_s": strategy.timeout_s}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "error": str(exc), "seconds": time.monotonic() - start,
                "timeout_s": strategy.timeout_s}  # fmt: skip


def test_a_stalled_pipeline_transfer_names_the_stage_the_peer_and_the_microbatch():
    # the suite's worlds use a short collective timeout, which MegatronStrategy inherits:
    # the planted deadlock fails in seconds, not at the harness's limit
    stage1 = run_world(_planted_pipeline_deadlock, 2, timeout=60, pg_timeout=2)[1]
    assert stage1["timeout_s"] == 2
    assert stage1["type"] == CollectiveTimeoutError.__name__, stage1
    assert (
        "pipeline stage 1 (rank 1) waited for microbatch 0's input activation (virtual stage 1) "
        "from rank 0 (stage 0)"
    ) in stage1["error"]
    assert stage1["seconds"] < 20

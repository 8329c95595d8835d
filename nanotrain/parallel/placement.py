"""Which pipeline rank holds which virtual stage.

The layers are cut into ``pp × num_chunks`` virtual stages in model order (`partition_layers`
in `nanotrain.parallel.pipeline`); a placement says on which rank, as which local chunk,
each one lives:

- interleaved (Megatron's, Narayanan et al. 2021 section 2.2.2): virtual stage ``k`` is
  chunk ``k // pp`` of rank ``k % pp``, so a microbatch walks the ranks ``num_chunks`` times
  round, from the last rank back to the first between laps. With one chunk rank r holds
  stage r.
- V (DualPipeV's, two chunks): rank r holds stage r as chunk 0 and stage ``2·pp - 1 - r`` as
  chunk 1. A microbatch goes down the ranks and back up: rank 0 embeds the tokens and also
  computes the loss, and rank ``pp - 1`` hands chunk 0's output to its own chunk 1 (no
  transfer).

Pure: no process group, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanotrain.parallel.schedules import V_SHAPED_SCHEDULES

__all__ = ["StagePlacement"]


@dataclass(frozen=True)
class StagePlacement:
    """Where each of the ``pp × num_chunks`` virtual stages lives.

    Args:
        pp: pipeline ranks.
        num_chunks: chunks per rank (virtual_pp).
        v_shape: DualPipeV's V placement (needs ``num_chunks == 2``); False: interleaved.

    Raises:
        ValueError: for sizes below 1, or a V with other than two chunks.
    """

    pp: int
    num_chunks: int = 1
    v_shape: bool = False

    def __post_init__(self) -> None:
        if self.pp < 1 or self.num_chunks < 1:
            raise ValueError(f"need pp, virtual_pp >= 1, got {self.pp}, {self.num_chunks}")
        if self.v_shape and self.num_chunks != 2:
            raise ValueError(
                f"a V placement holds two chunks per rank, got virtual_pp={self.num_chunks}"
            )

    @classmethod
    def for_schedule(cls, schedule: str | None, pp: int, num_chunks: int) -> StagePlacement:
        """The placement `schedule` (a `SCHEDULES` name, or None) runs on."""
        return cls(pp, num_chunks, schedule in V_SHAPED_SCHEDULES)

    @property
    def num_virtual(self) -> int:
        """Virtual stages in the pipeline (pp × num_chunks)."""
        return self.pp * self.num_chunks

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage held by ``rank`` as its local ``chunk``."""
        if self.v_shape:
            return rank if chunk == 0 else 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def locate(self, stage: int) -> tuple[int, int]:
        """(rank, local chunk) holding virtual ``stage``."""
        if self.v_shape:
            return (stage, 0) if stage < self.pp else (2 * self.pp - 1 - stage, 1)
        return stage % self.pp, stage // self.pp

    def stages_of(self, rank: int) -> list[int]:
        """Virtual stages of ``rank``, by local chunk."""
        return [self.stage(rank, c) for c in range(self.num_chunks)]

    def holds_first(self, rank: int) -> bool:
        """Whether ``rank`` holds virtual stage 0 (it embeds the tokens)."""
        return self.locate(0)[0] == rank

    def holds_last(self, rank: int) -> bool:
        """Whether ``rank`` holds the last virtual stage (head, loss, MTP)."""
        return self.locate(self.num_virtual - 1)[0] == rank

"""`MegatronStrategy`'s process environment: joining (or creating) the process group, the
device, the `ParallelMesh` of groups and the pipeline engine (`setup_environment`), and the
ranks-per-node size that node-limited expert dispatch groups by (`_node_size`)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from nanotrain.parallel.collectives import all_gather_along_dim
from nanotrain.parallel.mesh import MeshLayout, ParallelMesh
from nanotrain.parallel.node_dispatch import node_split
from nanotrain.parallel.schedules import V_SHAPED_SCHEDULES
from nanotrain.strategies.megatron_pipeline import (
    PipelineEngine,
    check_pairing_device,
    embedding_groups,
)
from nanotrain.strategies.rendezvous import (
    DEFAULT_TIMEOUT_S,
    default_group_timeout_s,
    env_int,
    join_process_group,
    launched_world_size,
    process_device,
)


class MegatronEnvironment:
    """Mixin of `MegatronStrategy` (which holds the attributes it reads: the sizes, backend,
    timeout, schedule and node options, and ``validate_world``)."""

    def setup_environment(self) -> None:
        """Join the process group (creating it under torchrun; none for one process), pick
        the device, build the mesh and, under pp > 1, the pipeline engine. Idempotent.

        Raises:
            ValueError: a layout that does not fit the world (before any process group), or
                node-limited dispatch asked for where it cannot apply.
        """
        if self._mesh is not None:
            return
        world = launched_world_size()
        self.validate_world(world)  # before any process group exists
        if self.timeout_s is None:  # the group the process is in decides, else torch's default
            self.timeout_s = default_group_timeout_s() or DEFAULT_TIMEOUT_S
        # one process needs no group (unless the user made one)
        if world > 1 and join_process_group("MegatronStrategy", self.backend, self.timeout_s):
            self._owns_process_group = True
        self._device = process_device(self.backend)
        if self.overlap_forward_backward:
            check_pairing_device(self._device)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        v_shape = self.schedule in V_SHAPED_SCHEDULES
        self._mesh = ParallelMesh.build(
            self.tp,
            self.pp,
            self.ep,
            self.replicas,
            cp=self.cp,
            timeout=timeout,
            pipeline_v_shape=v_shape,
            paired_chunks=self.overlap_forward_backward,
            ranks_per_node=self._agreed_node_size(world),
        )
        if self.node_limited_dispatch and self._mesh.ep_node_groups is None:
            raise ValueError(
                f"node_limited_dispatch=True, but the expert-parallel group (ep={self.ep}) lies "
                f"on one node of {self._node_size(world) or world} ranks; pass ranks_per_node "
                "(or launch on several nodes), or node_limited_dispatch=None"
            )
        if self._mesh.pp_size > 1:
            group = embedding_groups(self._mesh, timeout)
            self._pipeline = PipelineEngine(
                self._mesh,
                self.schedule,
                self.virtual_pp,
                self._device,
                group,
                overlap=self.overlap_forward_backward,
            )

    def _agreed_node_size(self, world: int) -> int | None:
        """`_node_size`, checked to be the same on every rank (each reads its own
        LOCAL_WORLD_SIZE): ranks that disagree would make different groups and hang.

        Raises:
            ValueError: on every rank, naming the sizes seen.
        """
        size = self._node_size(world)
        if world == 1 or self.ep == 1 or self.node_limited_dispatch is False:
            return size
        mine = torch.tensor([size or 0], dtype=torch.int64, device=self._device)
        seen = sorted(set(all_gather_along_dim(mine, 0, dist.group.WORLD).tolist()))
        if len(seen) > 1:
            raise ValueError(
                f"the ranks see different node sizes for node-limited dispatch ({seen}; 0: "
                "flat); launch with the same number of processes on every node, pass "
                "ranks_per_node=, or node_limited_dispatch=False"
            )
        return size

    def _node_size(self, world: int) -> int | None:
        """Ranks per node for node-limited dispatch, or None where it is off."""
        if self.node_limited_dispatch is False or self.ep == 1:
            return None
        size = self.ranks_per_node or env_int("LOCAL_WORLD_SIZE") or world
        if self.node_limited_dispatch is None:  # where the ep groups do not split: flat
            dp = self.validate_world(world)
            layout = MeshLayout(tp=self.tp, pp=self.pp, dp=dp, ep=self.ep, cp=self.cp)
            try:
                for ranks in layout.groups("ep"):
                    node_split(ranks, size)
            except ValueError:
                return None
        return size

"""Count the bytes each rank puts on the wire, per named process group, while code runs.

`CommMeter` is a context manager that routes the `torch.distributed` collectives and
point-to-point calls through a counter (and restores them on exit)::

    meter = CommMeter.for_strategy(strategy)   # names the mesh's groups: "tp", "dp", ...
    with meter:
        trainer.fit(...)                       # or one strategy.forward_backward(...)
    meter.bytes["tp"]                          # wire bytes this rank sent on its tp group

Bytes on the wire per rank follow the ring model (Patarasuk & Yuan 2009; what NCCL's ring
algorithms send) for a group of g ranks and a tensor of N bytes:

* all-reduce: 2 (g-1)/g N (a reduce-scatter then an all-gather);
* all-gather (N = the gathered, full tensor) and reduce-scatter (N = the full input):
  (g-1)/g N;
* broadcast: (g-1)/g N (a pipelined ring: every rank but the last forwards the whole tensor,
  averaged over the ranks);
* all-to-all: the rows this rank sends to the *other* ranks (its input split sizes; without
  splits (g-1)/g N);
* send / isend (also inside ``batch_isend_irecv``): N; a receive sends nothing.

Which functions are counted: ``all_reduce``, ``all_gather``, ``all_gather_into_tensor`` /
``all_gather_single``, ``reduce_scatter``, ``reduce_scatter_tensor`` /
``reduce_scatter_single``, ``all_to_all``, ``all_to_all_single``, ``broadcast``, ``send``,
``isend``, ``recv``, ``irecv`` and ``batch_isend_irecv``, in the ``torch.distributed``
namespace and in every already-imported module under `modules` (default ``nanotrain``) that
holds one of them under a module-level name (``nanotrain.parallel.collectives`` keeps
``_all_gather_single``, for instance). A call made from inside a counted call is not counted
again. The helpers ``*_object`` are not patched; what they call through the namespace is.

Every call is also kept in `events` (group, operation, dtype, elements, wire bytes), so a
caller can split a group's bytes further (e.g. by dtype).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["COUNTED", "CommEvent", "CommMeter", "wire_bytes"]

_P2P = ("send", "isend", "recv", "irecv")

#: the torch.distributed functions the meter counts
COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "send",
    "isend",
    "recv",
    "irecv",
    "batch_isend_irecv",
)


@dataclass(frozen=True)
class CommEvent:
    """One counted call.

    Attributes:
        group: the group's name (see `CommMeter`).
        op: the torch.distributed function name ("isend" for each send of a batch).
        dtype: dtype of the tensor on the wire.
        numel: elements of the tensor the ring model is applied to (for all-to-all: the
            rows sent to other ranks).
        bytes: wire bytes this rank sent.
    """

    group: str
    op: str
    dtype: torch.dtype
    numel: int
    bytes: float


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group: Any) -> int:
    return dist.get_world_size(group)


def wire_bytes(op: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, float, int]:
    """(the tensor whose dtype is on the wire, wire bytes this rank sends, elements counted)
    of one call of the torch.distributed function `op` with `args` / `kwargs`, by the ring
    model of the module docstring."""

    def arg(i: int, name: str) -> Any:
        return args[i] if len(args) > i else kwargs.get(name)

    group = kwargs.get("group")
    if op in ("send", "isend"):
        t = arg(0, "tensor")
        return t, float(_nbytes(t)), t.numel()
    if op in ("recv", "irecv"):
        t = arg(0, "tensor")
        return t, 0.0, 0
    g = _size(group)
    ring = (g - 1) / g
    if op == "all_reduce":
        t = arg(0, "tensor")
        return t, 2 * ring * _nbytes(t), t.numel()
    if op == "broadcast":
        t = arg(0, "tensor")
        return t, ring * _nbytes(t), t.numel()
    if op in ("all_gather_into_tensor", "all_gather_single"):
        t = arg(0, "output_tensor")
        return t, ring * _nbytes(t), t.numel()
    if op == "all_gather":
        pieces = arg(0, "tensor_list")
        numel = sum(p.numel() for p in pieces)
        return pieces[0], ring * sum(_nbytes(p) for p in pieces), numel
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        t = arg(1, "input")
        return t, ring * _nbytes(t), t.numel()
    if op == "reduce_scatter":
        pieces = arg(1, "input_list")
        return pieces[0], ring * sum(_nbytes(p) for p in pieces), sum(p.numel() for p in pieces)
    me = dist.get_rank(group)
    if op == "all_to_all":
        pieces = arg(1, "input_tensor_list")
        sent = [p for r, p in enumerate(pieces) if r != me]
        return pieces[0], float(sum(_nbytes(p) for p in sent)), sum(p.numel() for p in sent)
    if op == "all_to_all_single":
        t = arg(1, "input")
        splits = arg(3, "input_split_sizes")
        if not splits:
            return t, ring * _nbytes(t), round(ring * t.numel())
        row = t[0].numel() if t.dim() > 0 and t.shape[0] > 0 else 0
        rows = sum(n for r, n in enumerate(splits) if r != me)
        return t, float(rows * row * t.element_size()), rows * row
    raise ValueError(f"the meter does not count {op!r}")


class CommMeter:
    """Counts wire bytes and calls per named group while active (a context manager).

    Args:
        groups: name -> process group. A call on a group not named here is filed under
            "world" (the default group, or ``group=None``) or "unnamed".
        modules: prefixes of the modules whose module-level aliases of the counted functions
            are patched too.
        peers: global rank -> group name for point-to-point transfers on the default group
            (nanotrain's pipeline sends to global ranks: `for_strategy` files those to this
            rank's pipeline peers under "pp").

    Attributes:
        bytes: group name -> wire bytes sent by this rank.
        calls: group name -> number of counted calls (each send of a batch counts one,
            receives none).
        events: every counted call, in order (`CommEvent`).
        counting: set False to pause counting while still patched.
    """

    def __init__(
        self,
        groups: dict[str, Any] | None = None,
        modules: Iterable[str] = ("nanotrain",),
        peers: dict[int, str] | None = None,
    ) -> None:
        self.names = {id(g): name for name, g in (groups or {}).items() if g is not None}
        self.peers = dict(peers or {})
        self.modules = tuple(modules)
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.events: list[CommEvent] = []
        self.counting = True
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._p2p: dict[int, Callable[..., Any]] = {}

    @classmethod
    def for_strategy(cls, strategy: Any, **kwargs: Any) -> CommMeter:
        """A meter naming a `MegatronStrategy`'s groups (after `setup_environment`): "tp",
        "pp" (with the pipeline's per-direction channels), "dp", "ep", "expert_dp" and, under
        pipelining, "embedding" (the first and last stage's group, which sums a shared
        embedding's gradient); under node-limited dispatch "ep_intra" (the hop inside a
        node) and "ep_inter" (the rail between nodes)."""
        mesh = strategy.mesh
        groups = {
            "tp": mesh.tp_group,
            "pp": mesh.pp_group,
            "dp": mesh.dp_group,
            "ep": mesh.ep_group,
            "expert_dp": mesh.expert_dp_group,
        }
        pipeline = getattr(strategy, "_pipeline", None)
        if pipeline is not None:
            groups["embedding"] = pipeline.embedding_group
        nodes = mesh.ep_node_groups
        if nodes is not None:
            groups["ep_inter"] = nodes.inter
            if nodes.intra is not None:
                groups["ep_intra"] = nodes.intra
        peers = {r: "pp" for r in mesh.group_ranks("pp") if r != mesh.rank}
        meter = cls(groups, peers=peers, **kwargs)
        # the pipeline's transfers go over one two-rank group per direction
        meter.names.update({id(g): "pp" for g in mesh.pp_channels.values()})
        return meter

    def name_of(self, group: Any) -> str:
        """The name a call on `group` is filed under."""
        if id(group) in self.names:
            return self.names[id(group)]
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return "unnamed"

    def reset(self) -> None:
        """Forget what was counted so far."""
        self.bytes.clear()
        self.calls.clear()
        self.events.clear()

    def by_dtype(self, group: str) -> dict[torch.dtype, float]:
        """Wire bytes sent on `group`, split by the dtype on the wire."""
        out: dict[torch.dtype, float] = defaultdict(float)
        for e in self.events:
            if e.group == group:
                out[e.dtype] += e.bytes
        return dict(out)

    def _record(self, op: str, group: Any, args: tuple, kwargs: dict, peer: Any = None) -> None:
        if op in ("recv", "irecv"):
            return  # the sender counts the bytes and the call
        tensor, sent, numel = wire_bytes(op, args, {**kwargs, "group": group})
        name = self.name_of(group)
        if peer in self.peers and name == "world":
            name = self.peers[peer]
        self.bytes[name] += sent
        self.calls[name] += 1
        self.events.append(CommEvent(name, op, tensor.dtype, numel, sent))

    def _wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        group_pos = {
            "all_reduce": 2,
            "all_gather": 2,
            "all_gather_into_tensor": 2,
            "all_gather_single": 2,
            "reduce_scatter": 3,
            "reduce_scatter_tensor": 3,
            "reduce_scatter_single": 3,
            "all_to_all": 2,
            "all_to_all_single": 4,
            "broadcast": 2,
            "send": 2,
            "isend": 2,
            "recv": 2,
            "irecv": 2,
        }

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting and self._depth == 0:
                if op == "batch_isend_irecv":
                    for p2p in args[0] if args else kwargs["p2p_op_list"]:
                        kind = getattr(p2p.op, "__name__", "")
                        self._record(kind, p2p.group, (p2p.tensor,), {}, p2p.peer)
                else:
                    pos = group_pos[op]
                    group = args[pos] if len(args) > pos else kwargs.get("group")
                    peer = None
                    if op in _P2P:
                        peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
                    self._record(op, group, args, kwargs, peer)
            if op == "batch_isend_irecv":
                self._rewrap_p2p_ops(args[0] if args else kwargs["p2p_op_list"])
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        counted.__name__ = op
        return counted

    def __enter__(self) -> CommMeter:
        if self._saved:
            raise RuntimeError("this CommMeter is already active")
        originals = {op: getattr(dist, op) for op in COUNTED if hasattr(dist, op)}
        wrapped = {op: self._wrap(op, fn) for op, fn in originals.items()}
        self._p2p = {id(originals[op]): wrapped[op] for op in _P2P}
        by_id = {id(fn): op for op, fn in originals.items()}
        targets: list[tuple[Any, str, str]] = [(dist, op, op) for op in originals]
        # P2POp accepts only c10d's own isend / irecv, by identity: those are replaced too
        targets += [(c10d, op, op) for op in _P2P]
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(self.modules):
                continue
            for attr, value in list(vars(module).items()):
                if callable(value) and id(value) in by_id:
                    targets.append((module, attr, by_id[id(value)]))
        for owner, attr, op in targets:
            self._saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, wrapped[op])
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved = []

    def _rewrap_p2p_ops(self, ops: Iterable[Any]) -> None:
        """Give P2POps built before the meter started the counted isend / irecv:
        `batch_isend_irecv` tells sends from receives by identity with c10d's functions,
        which are the counted ones while the meter is active."""
        for p2p in ops:
            wrapper = self._p2p.get(id(p2p.op))
            if wrapper is not None:
                p2p.op = wrapper

"""Checks of a parallel layout (sizes, and how they fit the world and the model), run before
any process group exists; their errors name the offending numbers and the valid choices."""

from __future__ import annotations

import functools

__all__ = ["check_context", "check_sizes", "divisors", "validate_layout"]


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending."""
    return list(_divisors(n))


@functools.lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:
    # every layout check lists them (a planner's search checks thousands of layouts)
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def check_sizes(**sizes: int | None) -> None:
    """Check that every given parallel size is an int >= 1 (None: not given).

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is below 1.
    """
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_tp(world_size: int, tp: int, num_heads: int | None, num_kv_heads: int | None) -> None:
    """tp must divide the world and the number of (kv) heads, each rank owning whole heads."""
    constraints = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "world_size": world_size}
    constraints = {k: v for k, v in constraints.items() if v is not None}
    valid = [t for t in divisors(world_size) if all(v % t == 0 for v in constraints.values())]
    for name, value in constraints.items():
        if value % tp != 0:
            raise ValueError(
                f"tp={tp} does not divide {name}={value}; valid tp values: {_fmt(valid)}"
            )


def validate_layout(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dp: int | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    num_layers: int | None = None,
) -> int:
    """Check a parallel layout against the world size and the model, before any group exists.

    Args:
        world_size: total number of ranks.
        tp, pp, ep: tensor-, pipeline- and expert-parallel sizes.
        dp: data-parallel size; ``None`` infers ``world_size // (tp * pp)``.
        num_heads, num_kv_heads: attention heads; tp must divide both (whole heads per rank).
        vocab_size: vocabulary; any size works because ``VocabParallelEmbedding`` pads it.
        num_experts: routed experts; ep must divide it (whole experts per rank).
        num_layers: transformer layers; each pipeline stage needs at least one (pp <= layers).

    Returns:
        The data-parallel size ``dp`` (inferred or as given).

    Raises:
        TypeError: if a size is not an int.
        ValueError: naming the offending numbers and listing valid alternatives.
    """
    check_sizes(
        world_size=world_size, tp=tp, pp=pp, ep=ep, dp=dp, num_heads=num_heads,
        num_kv_heads=num_kv_heads, vocab_size=vocab_size, num_experts=num_experts,
        num_layers=num_layers,
    )  # fmt: skip
    _check_tp(world_size, tp, num_heads, num_kv_heads)
    if world_size % (tp * pp) != 0:
        valid = [p for p in divisors(world_size // tp)]
        raise ValueError(
            f"tp*pp={tp}*{pp}={tp * pp} does not divide world_size={world_size}; "
            f"with tp={tp}, valid pp values: {_fmt(valid)}"
        )
    if dp is None:
        dp = world_size // (tp * pp)
    if tp * pp * dp != world_size:
        raise ValueError(
            f"tp*pp*dp={tp}*{pp}*{dp}={tp * pp * dp} must equal world_size={world_size}; "
            f"use dp={world_size // (tp * pp)} (or leave dp unset to infer it)"
        )
    if dp % ep != 0:
        valid = [e for e in divisors(dp) if num_experts is None or num_experts % e == 0]
        raise ValueError(
            f"ep={ep} does not divide dp={dp} (expert parallelism is carved out of data "
            f"parallelism); valid ep values: {_fmt(valid)}"
        )
    if num_experts is not None and num_experts % ep != 0:
        valid = [e for e in divisors(dp) if num_experts % e == 0]
        raise ValueError(
            f"ep={ep} does not divide num_experts={num_experts}; valid ep values: {_fmt(valid)}"
        )
    if num_layers is not None and pp > num_layers:
        valid = [p for p in divisors(world_size // tp) if p <= num_layers]
        raise ValueError(
            f"pp={pp} exceeds num_layers={num_layers} (every stage needs a layer); "
            f"valid pp values: {_fmt(valid)}"
        )
    return dp


def check_context(replicas: int, cp: int) -> None:
    """Context parallelism is carved out of the weight replicas (the data-parallel axis):
    ``cp`` must be an int >= 1 dividing ``replicas`` (= data-parallel x context-parallel).

    Raises:
        TypeError: cp is not an int.
        ValueError: cp < 1 or it does not divide ``replicas``.
    """
    check_sizes(cp=cp)
    if replicas % cp != 0:
        raise ValueError(
            f"cp={cp} does not divide the {replicas} weight replicas (data x context "
            f"parallel ranks); valid cp values: {_fmt(divisors(replicas))}"
        )

"""Steps written without `batch_idx`, called as Lightning calls them.

Lightning inspects each step's signature (`is_param_in_hook_signature(step, "batch_idx",
min_args=2)`) and passes `batch_idx` only to a step that takes it: `training_step(self,
batch)` is a valid Lightning module. The strategies call every step as `step(batch,
batch_idx)`, so for the length of a stage a step that does not take it is shadowed on the
instance by a `StepWithoutBatchIdx` that leaves the index out (`adapt_steps`;
`restore_steps` removes it); it survives `copy.deepcopy` and pickling of the module.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def adapt_steps(module: Any) -> None:
    """Shadow each step of `module` that does not take `batch_idx` (as Lightning decides) with
    one that takes it and leaves it out."""
    for name in STEPS:
        step = getattr(module, name, None)
        if step is None or isinstance(step, StepWithoutBatchIdx):
            continue
        if is_param_in_hook_signature(step, "batch_idx", min_args=2):
            continue
        own = module.__dict__.get(name)  # a step set on the instance itself (rare)
        module.__dict__[name] = StepWithoutBatchIdx(module, name, own)


def restore_steps(module: Any) -> None:
    """Remove the wrappers `adapt_steps` put on `module`."""
    for name in STEPS:
        wrapper = module.__dict__.get(name)
        if isinstance(wrapper, StepWithoutBatchIdx):
            if wrapper.own is None:
                del module.__dict__[name]
            else:
                module.__dict__[name] = wrapper.own


class StepWithoutBatchIdx:
    """`module.<name>` called as `step(batch, batch_idx)` with `batch_idx` left out.

    It keeps the module and the step's name, not a bound method, and resolves the step at
    each call: `copy.deepcopy(module)` mid-stage gives a copy whose wrapper calls the copy's
    own step, and the module pickles (both as Lightning's modules do, which have no wrapper).

    Args:
        module: the module whose step this is.
        name: "training_step", "validation_step", "test_step" or "predict_step".
        own: the step when it was set on the instance rather than defined by the class.
    """

    drops_batch_idx = True

    def __init__(self, module: Any, name: str, own: Any = None) -> None:
        self.module, self.name, self.own = module, name, own

    def __call__(self, batch: Any, batch_idx: int | None = None, *args: Any, **kwargs: Any) -> Any:
        """The step on `batch` (and any further arguments), without `batch_idx`."""
        if self.own is not None:
            return self.own(batch, *args, **kwargs)
        return getattr(type(self.module), self.name)(self.module, batch, *args, **kwargs)

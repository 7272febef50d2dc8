"""FlopCounterMode with the kernels it counts wrongly taken out (shared by the FLOP tests).

FlopCounterMode is exact for matmuls, and wrong by construction for some kernels: a depthwise
conv's backward ignores ``groups`` (counted ~channels x too high), the chunked linear-attention
and state-space kernels form intra-chunk matrices and solve triangular systems (counted in
part, or 0 for ``linalg_solve_triangular``) where the estimate counts the recurrent-equivalent
cost. :func:`count_training_step` records every call of such a kernel during the step, counts
each recorded call again alone (forward + backward, same shapes, same inputs requiring grad),
and returns both totals, so a test compares everything else exactly and checks the kernels'
components against the module dimensions on their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

#: Kernel functions of transformers' modeling modules whose counter FLOPs are taken out, and
#: the estimate components that stand for them (found in any modeling module defining them).
KERNEL_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "torch_chunk_gated_delta_rule": ("linear_attention_core",),
    "chunk_kimi_delta_attention": ("linear_attention_core",),
    "mamba_scan_forward": ("mamba_core",),
    "mamba2_scan_forward": ("mamba_core",),
}
#: Modules whose kernel is written inline in their forward (by class-name suffix), taken out
#: whole: MiniMax's block-wise lightning attention (intra-block score matrices where the
#: estimate counts the recurrent-equivalent state updates), and the indexers that score only
#: some of the queries (Qwen4's QSA: its visible blocks; Kolibri 1.1: the queries that see more
#: keys than the budget) where the estimate scores every pair the attention mode covers.
KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "LightningAttention": ("linear_attention_projections", "linear_attention_core"),
    "QSAIndexer": ("indexer",),
    "Kolibri1_1Indexer": ("indexer",),
}


class _NoModuleTracking:
    """Stands in for FlopCounterMode's module tracker: every count goes to "Global" only."""

    parents = ("Global",)

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class TotalFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` counting the total only: the same per-op formulas, without the
    module tracker, whose hooks on every module call take most of the counter's time."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _NoModuleTracking()


@dataclasses.dataclass
class KernelCall:
    """One recorded kernel call: what to run again alone, and what it stands for."""

    function: Callable[..., Any]
    args: tuple
    kwargs: dict
    components: tuple[str, ...]  # empty: a 1-D convolution (its weight is in ``conv_weight``)
    conv_weight: torch.Tensor | None = None
    tokens: int = 0  # the length of the sequence being run when the call was made


@dataclasses.dataclass
class StepCount:
    """Counter FLOPs of one training step, the recorded kernel calls and their own counts."""

    total: float
    calls: list[KernelCall]
    kernel_total: float

    @property
    def rest(self) -> float:
        """Everything the counter counted outside the recorded kernels."""
        return self.total - self.kernel_total


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        snap = value.detach().clone()
        snap.requires_grad_(value.requires_grad)  # a marker only, re-created by _fresh
        return _Marked(snap, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


@dataclasses.dataclass
class _Marked:
    tensor: torch.Tensor
    requires_grad: bool


def _shapes(value: Any) -> Any:
    """A hashable summary of recorded arguments: tensor shapes, dtypes and grad flags."""
    if isinstance(value, _Marked):
        return (tuple(value.tensor.shape), value.tensor.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_shapes(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _shapes(v)) for k, v in value.items()))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return type(value).__name__  # a module: same class and input shapes, same count


def _restore(value: Any) -> Any:
    if isinstance(value, _Marked):
        copy = value.tensor.detach().clone()
        return copy.requires_grad_(value.requires_grad and copy.is_floating_point())
    if isinstance(value, (list, tuple)):
        return type(value)(_restore(v) for v in value)
    if isinstance(value, dict):
        return {k: _restore(v) for k, v in value.items()}
    return value


def _main_output(value: Any) -> torch.Tensor | None:
    """The kernel's output (the first tensor); a returned final state is unused in training."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _main_output(value[0])
    return None


def count_alone(call: KernelCall) -> float:
    """Counter FLOPs of one recorded call run again alone: forward + backward."""
    args, kwargs = _restore(call.args), _restore(call.kwargs)
    counter = TotalFlopCounter()
    with counter:
        out = _main_output(call.function(*args, **kwargs))
        if out is not None and out.requires_grad:
            out.float().sum().backward()
    return float(counter.get_total_flops())


@contextlib.contextmanager
def recording(modeling: Any, tokens: list[int]) -> Iterator[list[KernelCall]]:
    """Record the kernel calls of ``modeling`` (a transformers modeling module) and every 1-D
    convolution while the block runs; nested calls inside a recorded one are not recorded.
    ``tokens[0]`` is the length of the sequence being run (set by the caller)."""
    calls: list[KernelCall] = []
    depth = [0]
    patches: list[tuple[Any, str, Any]] = []

    def record(function: Callable[..., Any], components: tuple[str, ...], args, kwargs) -> None:
        if depth[0] == 0:
            weight = None
            if not components:
                weight = (args[1] if len(args) > 1 else kwargs["weight"]).detach()
            call = KernelCall(function, _snapshot(args), _snapshot(kwargs), components, weight)
            call.tokens = tokens[0]
            calls.append(call)

    def recorder(function: Callable[..., Any], components: tuple[str, ...]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            record(function, components, args, kwargs)
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    def module_recorder(forward: Callable[..., Any], components: tuple[str, ...]):
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            record(functools.partial(forward, self), components, args, kwargs)
            depth[0] += 1
            try:
                return forward(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    for name, components in KERNEL_FUNCTIONS.items():
        original = getattr(modeling, name, None)
        if original is not None:
            patches.append((modeling, name, original))
            setattr(modeling, name, recorder(original, components))
    for cls in list(vars(modeling).values()):
        if not isinstance(cls, type) or cls.__module__ != modeling.__name__:
            continue
        for suffix, components in KERNEL_MODULES.items():
            if cls.__name__.endswith(suffix):
                patches.append((cls, "forward", cls.forward))
                cls.forward = module_recorder(cls.forward, components)
    functional = torch.nn.functional
    patches.append((functional, "conv1d", functional.conv1d))
    functional.conv1d = recorder(functional.conv1d, ())
    try:
        yield calls
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def count_training_step(model: Any, lengths: list[int], seed: int = 0) -> StepCount:
    """Counter FLOPs of forward + backward, one pass per sequence, kernels recorded."""
    import importlib

    modeling = importlib.import_module(type(model).__module__)
    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.config.get_text_config().vocab_size)
    counter = TotalFlopCounter()
    current = [0]
    with recording(modeling, current) as calls, counter:
        for n in lengths:
            current[0] = n
            ids = torch.randint(1, vocab, (1, n), generator=generator)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    # Calls with the same shapes count the same: run each kind once (layers repeat them).
    alone: dict[Any, float] = {}
    kernel_total = 0.0
    for call in calls:
        function = getattr(call.function, "func", call.function)  # a module's bound forward
        key = (function, _shapes(call.args), _shapes(call.kwargs))
        if key not in alone:
            alone[key] = count_alone(call)
        kernel_total += alone[key]
    model.zero_grad(set_to_none=True)
    return StepCount(float(counter.get_total_flops()), calls, kernel_total)

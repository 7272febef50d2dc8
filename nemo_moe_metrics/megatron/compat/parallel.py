"""megatron-core's parallel state, consulted only when the program already uses it.

Importing megatron-core is slow and optional: these read ``megatron.core.parallel_state`` only
when it is imported and initialised (a megatron program), and answer as a single-group program
otherwise (Hugging Face, torchtitan, a bare ``torch.distributed`` job).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


def parallel_state() -> ModuleType | None:
    """megatron-core's ``parallel_state`` when the program uses it (imported, initialised)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return ps
    return None


def pipeline_stage() -> int:
    """This rank's pipeline stage (0 without megatron's parallel state)."""
    ps = parallel_state()
    return ps.get_pipeline_model_parallel_rank() if ps is not None else 0


def tensor_parallel_replica() -> bool:
    """Whether this rank repeats tensor-parallel rank 0's tokens (TP rank > 0)."""
    ps = parallel_state()
    return ps is not None and (
        ps.get_tensor_model_parallel_world_size() > 1 and ps.get_tensor_model_parallel_rank() != 0
    )


def context_parallel_size() -> int:
    """Ranks one sequence is split over (context parallel; 1 without megatron)."""
    ps = parallel_state()
    return int(ps.get_context_parallel_world_size()) if ps is not None else 1


def data_parallel_group() -> Any:
    """megatron's data-parallel group (context parallel excluded); None: every rank is a
    data-parallel replica (DDP, FSDP)."""
    ps = parallel_state()
    return ps.get_data_parallel_group(with_context_parallel=False) if ps is not None else None


def expert_parallel_group() -> tuple[Any, int]:
    """``(megatron's expert-parallel group, this rank's place in it)``; ``(None, 0)``
    without megatron's parallel state."""
    ps = parallel_state()
    if ps is None:
        return None, 0
    return ps.get_expert_model_parallel_group(), int(ps.get_expert_model_parallel_rank())


__all__ = [
    "context_parallel_size",
    "data_parallel_group",
    "expert_parallel_group",
    "parallel_state",
    "pipeline_stage",
    "tensor_parallel_replica",
]

"""What the serving engines read, written from a plan. Only formats checked in the engines'
own sources are written:

- SGLang ``--init-expert-location FILE.json`` (sgl-project/sglang,
  ``python/sglang/srt/eplb/expert_location.py``, ``compute_initial_expert_location_metadata``,
  read at commit 01fec5c2e61f): a JSON object whose only key is ``physical_to_logical_map``,
  ``[layers][E + R]`` logical ids, one row per decoder layer of the model (SGLang's
  ``num_layers``, dense layers included: their rows are the trivial ``arange(E + R) % E`` that
  SGLang's own ``init_trivial`` builds), GPU ``g`` holding slots ``g*(E+R)/G ...``. Other keys
  would be passed on as arguments and fail, so there are none. SGLang must run with
  ``--ep-num-redundant-experts R`` and ``--ep-size G``.
- vLLM (vllm-project/vllm ``vllm/config/parallel.py``, ``EPLBConfig``, read at commit
  840e7972c6ab): vLLM reads no placement file; its EPLB computes the placement itself from its
  own counters at runtime. What it takes is ``--enable-eplb --eplb-config JSON`` whose
  ``num_redundant_experts`` is the ``R`` the sweep recommends, which is what is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import LAYERS
from nemo_moe_metrics.placement.plan import PlacementPlan

__all__ = ["sglang_init_expert_location", "vllm_eplb_config"]


def sglang_init_expert_location(plan: PlacementPlan, num_layers: int | None = None) -> dict:
    """``{"physical_to_logical_map": [[...] per decoder layer]}`` for SGLang's
    ``--init-expert-location``; ``num_layers`` (default: the last planned layer + 1) is the
    model's number of decoder layers."""
    ids = plan.layer_ids.tolist()
    num_layers = max(ids) + 1 if num_layers is None else num_layers
    if num_layers < 1 or max(ids) >= num_layers:
        raise ValueError(
            f"--sglang-layers {num_layers} does not cover the planned layers (up to "
            f"{max(ids)}); pass the model's number of decoder layers"
        )
    LAYERS.check(num_layers, f"--sglang-layers {num_layers}", "pass the model's decoder layers")
    physical = plan.physical_to_logical.shape[1]
    experts = plan.weight.shape[1]
    trivial = (np.arange(physical) % experts).tolist()
    rows: list[Any] = [trivial] * num_layers
    for row, layer in enumerate(ids):
        rows[layer] = plan.physical_to_logical[row].tolist()
    return {"physical_to_logical_map": rows}


def vllm_eplb_config(redundant_experts: int) -> dict:
    """vLLM's ``--eplb-config`` with the number of redundant experts."""
    return {"num_redundant_experts": int(redundant_experts)}

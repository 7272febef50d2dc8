"""Router load-balancing loss of Hugging Face MoE models, per layer, on the device.

transformers computes its auxiliary loss in ``load_balancing_loss_func`` (the Switch Transformer
loss) over the router logits of ALL layers concatenated, once per forward, and only with
``output_router_logits=True``; every family that trains with it shares one definition of that
function, except doge (product-key experts, :func:`doge_layer_load_balancing_loss`). This module
computes the same function on ONE layer's router logits at a time, in a forward hook on the
router the model records as ``router_logits`` (``adapters.hf.router_logit_sources``), gated
like the expert counts:

    loss_layer = E * sum_e f_e * P_e,   f_e = (top-k picks of expert e) / T,
                                        P_e = mean over the T tokens of softmax(logits)[:, e]

with the top-k taken on ``softmax(logits)`` exactly as transformers does (coefficient
``router_aux_loss_coef`` excluded, as megatron's tracker excludes its coefficient; padding
included, as transformers' function without ``attention_mask``). Calling
``load_balancing_loss_func((logits,), E, k)`` on one layer's logits gives the same number
(tests/moe/test_hf_aux_loss.py). Per layer the values are summed over the step's training forwards
on the device (no host synchronisation); at the end of the step :func:`enqueue_hf_aux_loss_metrics`
scales them by ``1 / num_microbatches``, reduces them with the same code as megatron's tracker
(``aux_loss.reduce_aux_losses``: mean over data parallel) and reports the mean over MoE layers
under the same keys (``moe/load_balancing_loss``, per layer ``moe/load_balancing_loss_layer_{i}``).

Beside it, ``moe/load_balancing_loss_real_tokens`` (per layer ``..._real_tokens_layer_{i}``):
the same function over the real tokens only (``f_e`` and ``P_e`` over the tokens the forward's
attention mask marks real), i.e. transformers' function given the ``attention_mask``, per layer;
every other ``moe/`` count leaves padding out the same way. Switch-style losses only (doge's
product keys get the first key alone). How these differ from megatron's and from transformers'
concatenated loss (what the model optimises, TRL's ``aux_loss``): docs/en/aux_loss.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from nemo_moe_metrics.export.host_read import Pending, collective_device
from nemo_moe_metrics.export.metric_names import AUX_LOSS_TRACKER_NAMES, REAL_TOKENS_LOSS
from nemo_moe_metrics.moe.aux_loss import (
    check_num_microbatches,
    reduce_aux_losses,
    summarize_aux_losses,
)
from nemo_moe_metrics.moe.deferred import FLUSH_BYTES, ConstantTensors, HostStaging, softmax
from nemo_moe_metrics.moe.router_spec import logits_of, rows_of

#: The one loss a Hugging Face MoE model defines, under megatron's tracker name, and the same
#: loss over the real tokens (switch-style losses).
HF_AUX_LOSS_NAMES: tuple[str, ...] = (AUX_LOSS_TRACKER_NAMES["aux_loss"], REAL_TOKENS_LOSS)


def layer_load_balancing_loss(router_logits: torch.Tensor, num_experts: int, top_k: int):
    """transformers' ``load_balancing_loss_func`` on one layer's ``[T, E]`` logits (0-d tensor).

    Device ops only: no host read, no branching on values.
    """
    logits = router_logits.detach()
    forward_of = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return forwards_load_balancing_loss(logits, forward_of, 1, num_experts, top_k)[0]


def forwards_load_balancing_loss(
    router_logits: torch.Tensor,
    forward_of: torch.Tensor,
    forwards: int,
    num_experts: int,
    top_k: int,
    selected: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`layer_load_balancing_loss` of ``forwards`` forwards at once, ``[forwards]``.

    ``router_logits`` ``[T, E]``: the forwards' tokens concatenated; ``forward_of`` ``[T]``:
    each token's forward. Each loss is over its own forward's tokens, as the per-layer
    function computes it; one pass for all. ``selected`` ``[T, top_k]``: the top-k of
    ``softmax(router_logits)`` where the routers returned it (None: taken here). ``real``
    ``[T]`` bool: only these tokens (transformers' function with the attention mask); a
    forward without one counts 0.
    """
    logits = router_logits.detach()
    weights = softmax(logits)
    if selected is None:
        _, selected = torch.topk(weights, top_k, dim=-1)
    token = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    if real is not None:
        token = real.to(torch.float32)
    slot = (forward_of.unsqueeze(1) * num_experts + selected).reshape(-1)
    picks = torch.zeros(forwards * num_experts, dtype=torch.float32, device=logits.device)
    picks.index_add_(0, slot, token.repeat_interleave(selected.shape[-1]))
    picks = picks.reshape(forwards, num_experts)
    prob_sum = torch.zeros(forwards, num_experts, dtype=torch.float32, device=logits.device)
    prob_sum.index_add_(0, forward_of, weights.float() * token.unsqueeze(-1))
    tokens = picks.sum(dim=1, keepdim=True) / top_k  # each token picks top_k experts: exact
    tokens = tokens.clamp(min=1.0)  # a forward of padding alone: 0, not 0/0
    return (picks / tokens * (prob_sum / tokens)).sum(dim=-1) * num_experts


def doge_layer_load_balancing_loss(
    router_logits: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """doge's ``load_balancing_loss_func`` on one layer's product-key logits ``[2, T, keys]``.

    Experts are the ``keys x keys`` sums of a query's two key scores; ``f_e`` is expert ``e``'s
    share of the ``T * top_k`` picks and ``P_e`` the mean softmax over all key pairs.
    """
    logits = router_logits.detach()
    num_keys = logits.shape[-1]
    (scores_x, scores_y), (indices_x, indices_y) = logits.topk(num_keys, dim=-1)
    scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)
    experts = (indices_x.unsqueeze(-1) * num_keys + indices_y.unsqueeze(-2)).flatten(-2)
    picked = experts.gather(-1, scores.topk(top_k, dim=-1).indices).reshape(-1)
    probs = torch.zeros_like(scores).scatter(-1, experts, torch.softmax(scores, dim=-1))
    picks = torch.zeros(num_experts, dtype=scores.dtype, device=scores.device)
    picks.scatter_add_(0, picked, torch.ones_like(picked, dtype=scores.dtype))
    return (picks / picked.shape[0] * probs.mean(dim=0)).sum() * num_experts


class HFAuxLossAccumulator:
    """Per-layer sum of the load-balancing loss over a step's training forwards, on device.

    ``values`` is ``[len(HF_AUX_LOSS_NAMES), num_layers]`` float32 (zeros for dense layers),
    the same shape megatron's tracker gives ``aux_loss.local_aux_loss_values``; ``layers`` are
    the layers whose routers feed it (every MoE layer with router logits).

    A forward's logits are kept, not reduced at once: :meth:`flush` (called by
    :func:`enqueue_hf_aux_loss_metrics`, or when the staging holds ``FLUSH_BYTES``)
    computes every kept forward in one pass, their tokens concatenated.
    """

    def __init__(
        self,
        num_layers: int,
        layers: list[int],
        kind: str = "switch",
        staging: HostStaging | None = None,
    ) -> None:
        """``num_layers``: decoder layers (the global layer ids index into them); ``layers``:
        the MoE layers with router logits; ``kind``: ``"switch"`` (transformers'
        ``load_balancing_loss_func``) or ``"doge"``; ``staging``: the host memory logits are
        kept in (the collector's, shared with its other trackers; None: one of its own)."""
        self.num_layers = num_layers
        self.layers = sorted(layers)
        self.kind = kind
        self.values = torch.zeros(len(HF_AUX_LOSS_NAMES), num_layers, dtype=torch.float32)
        self._kept: dict[tuple, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = {}
        self._constants = ConstantTensors()
        self._own_staging = staging is None  # a shared one is reset by its owner
        self._staging = staging if staging is not None else HostStaging()
        self._staging.add_consumer(self._add_kept_losses)

    def observer(self, logits_at: int, num_experts: int, top_k: int, ids_at: int | None = None):
        """A router-hook callback ``(layer_id, router, output)`` adding this forward's loss;
        ``ids_at``: where the output holds the top-k of ``softmax(logits)`` (the router's own
        expert ids, ``adapters.hf_health.softmax_topk_ids_at``), or None."""

        def observe(
            layer_id: int, module: nn.Module, output: Any, valid: torch.Tensor | None = None
        ) -> None:
            routed = ids_at is not None and isinstance(output, tuple) and len(output) > ids_at
            ids = output[ids_at] if routed else None
            self.add(layer_id, logits_of(output, logits_at), num_experts, top_k, ids, valid)

        return observe

    def add(
        self,
        layer_id: int,
        logits: torch.Tensor,
        num_experts: int,
        top_k: int,
        ids: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Keep one forward's router logits of ``layer_id`` for its loss (a copy into host
        staging memory on a CPU, a detach on an accelerator); ``ids``: the router's own top-k
        of their softmax, used where they are float32 ``[T, E]`` logits' ``[T, top_k]`` int64
        ids (in a lower precision, transformers' function ranks the rounded softmax);
        ``valid``: the forward's real tokens (``[T]`` bool; None: every token real)."""
        if logits.numel() == 0:  # metadata, not a value: an empty microbatch adds nothing
            return
        if self._staging.nbytes >= FLUSH_BYTES:  # compute what is kept before keeping more
            self._staging.flush()
        if ids is not None and not (
            self.kind == "switch"
            and logits.dtype == torch.float32
            and isinstance(ids, torch.Tensor)
            and ids.dtype == torch.int64
            and logits.dim() == 2
            and ids.shape == (logits.shape[0], top_k)
        ):
            ids = None
        shape = logits.shape[1:] if self.kind == "switch" else logits.shape  # tokens may vary
        key = (tuple(shape), logits.dtype, logits.device, num_experts, top_k, ids is not None)
        layers, kept, kept_ids, kept_real = self._kept.setdefault(key, ([], [], [], []))
        layers.append(layer_id)
        kept.append(self._staging.keep(logits))
        if ids is not None:
            kept_ids.append(self._staging.keep(ids))
        if self.kind == "switch":
            real = rows_of(valid, logits.shape[0])
            kept_real.append(
                self._staging.keep(real)
                if real is not None
                else self._constants.ones((logits.shape[0],), torch.bool, logits.device)
            )

    def flush(self) -> None:
        """Add every kept forward's loss to ``values``: one pass for all (device ops only);
        the staging's other consumers pass over theirs too."""
        self._staging.flush()

    def _add_kept_losses(self) -> None:
        kept, self._kept = self._kept, {}
        for (_, _, device, num_experts, top_k, _), (layers, logits, ids, real) in kept.items():
            if self.values.device != device:  # first forward, or the model moved
                self.values = self.values.to(device)
            index = self._constants.index(layers, device)
            if self.kind == "switch":
                forward_of = self._constants.segments([z.shape[0] for z in logits], device)
                selected = torch.cat(ids) if ids else None
                every = torch.cat(logits)
                args = (every, forward_of, len(logits), num_experts, top_k, selected)
                losses = forwards_load_balancing_loss(*args)
                real_losses = forwards_load_balancing_loss(*args, real=torch.cat(real))
                self.values[1].index_add_(0, index, real_losses.to(self.values.dtype))
            else:
                losses = torch.stack(
                    [doge_layer_load_balancing_loss(z, num_experts, top_k) for z in logits]
                )
            self.values[0].index_add_(0, index, losses.to(self.values.dtype))

    def reset(self) -> None:
        """Zero the sums and drop kept logits (start of a new step, or a step that raised)."""
        self.values.zero_()
        self._kept = {}
        if self._own_staging:
            self._staging.reset()


def _hf_groups(data_group: Any) -> SimpleNamespace:
    """The four groups ``reduce_aux_losses`` takes, for a model without TP/PP/CP.

    Every rank is a data-parallel replica: tensor/context and pipeline groups are the rank
    alone (``reduce_aux_losses`` skips collectives over a one-rank group, so a group of one
    is passed as the rank's own one-rank group, never the world).
    """
    single = _single_rank_group()
    return SimpleNamespace(pp=single, tp_cp=single, dp=data_group, tp_dp_cp=data_group)


_SINGLE: dict[int, Any] = {}


def _single_rank_group() -> Any:
    # new_subgroups is collective: made once per process, at the first export (every rank).
    rank = dist.get_rank()
    if rank not in _SINGLE:
        group, _ = dist.new_subgroups(group_size=1)
        _SINGLE[rank] = group
    return _SINGLE[rank]


def enqueue_hf_aux_loss_metrics(
    acc: HFAuxLossAccumulator,
    moe_layers: Sequence[int],
    *,
    num_microbatches: int,
    per_layer: bool,
    data_group: Any = None,
) -> Pending[dict[str, float]]:
    """``moe/load_balancing_loss`` (mean over ``moe_layers``) and optional per-layer keys, queued.

    Collective when torch.distributed is initialised: every rank calls it once per step.
    Scales this rank's sums by ``1/num_microbatches``, averages over ``data_group`` (None =
    world) through ``aux_loss.reduce_aux_losses`` and resets; the values are read with the
    export's one host read (:func:`~nemo_moe_metrics.export.host_read.read_once`).
    """
    check_num_microbatches(num_microbatches)
    acc.flush()
    values = acc.values.clone()
    acc.reset()
    values.div_(num_microbatches)
    if dist.is_available() and dist.is_initialized():
        values = values.to(collective_device(data_group, values.device))
        reduce_aux_losses(values, HF_AUX_LOSS_NAMES, pg_collection=_hf_groups(data_group))

    names = HF_AUX_LOSS_NAMES if acc.kind == "switch" else HF_AUX_LOSS_NAMES[:1]

    def finish(host: list[np.ndarray]) -> dict[str, float]:
        by_name = dict(zip(names, host[0].tolist()[: len(names)], strict=True))
        return summarize_aux_losses(by_name, moe_layers, per_layer=per_layer)

    return Pending((values,), finish)

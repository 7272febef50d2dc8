"""The metric-family protocol, and what a family's ``build`` function is given at attach.

A family owns what one flag (or one source) measures. ``PolicyMetrics``
(``nemo_moe_metrics.worker.policy_metrics``) calls every family at the same points of a step and
knows none of them:

- ``enter_step`` / ``leave_step``: around ``with metrics.step():``;
- ``microbatch``: per ``metrics.microbatch()`` call (host work only, no device read);
- ``discard``: the step raised; ``restart``: its forward-backward runs again;
- ``enqueue``: launch the device work and collectives of an export and return the
  :class:`~nemo_moe_metrics.export.host_read.Pending` results (same order on every rank; one host
  read then brings every family's numbers back), then ``check`` the reduced numbers and
  ``complete`` the dict with what follows from other families' numbers.

Each family module (``families/expert_load.py``, ...) defines its class and a
``build(context) -> MetricFamily | None`` that decides from the flags, the model's facts and
its model family whether the family applies; ``families.REGISTERED`` lists the builds in
export order. A family that needs each router forward subscribes to the collector
(``moe.subscriptions``); one that needs another family's result finds it with
:meth:`BuildContext.family` and reads its public attributes. docs/en/metric_families.md walks
through adding one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from nemo_moe_metrics.adapters.family import ModelFacts, ModelFamily
from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export.host_read import Pending
from nemo_moe_metrics.moe.collector import ExpertLoadCollector


class MetricFamily:
    """One metric family's part in a step; every hook is a no-op unless the family needs it."""

    #: True: the family reads ``microbatch(rollout_routes=...)`` (else the facade warns once
    #: that routes given are ignored)
    takes_rollout_routes = False

    def enter_step(self) -> None:
        """``with metrics.step():`` begins."""

    def leave_step(self) -> None:
        """The step block ends (after ``discard`` when it raised)."""

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """Wraps the body of the step block (the step timer)."""
        yield

    def microbatch(self, seq_lens: Any, rollout_routes: Any, num_sequences: int | None) -> None:
        """One ``metrics.microbatch()`` call; host bookkeeping only."""

    def discard(self) -> None:
        """The open step raised: forget what it added."""

    def restart(self) -> None:
        """The open step's forward-backward runs again: forget what it added so far."""
        self.discard()

    def resume(
        self, total_tokens: float, total_seconds: float, total_flops: float, restart: bool
    ) -> None:
        """``PolicyMetrics.resume_totals``: continue the run totals of a resumed run."""

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        """Launch this family's export (device ops, collectives); results come with the read."""
        return []

    def check(self, out: dict[str, Any], microbatches: int) -> None:
        """Refuse an export whose reduced numbers show misuse (same on every rank);
        ``microbatches``: this rank's ``microbatch()`` calls since the last export."""

    def complete(self, out: dict[str, Any]) -> None:
        """Add keys that follow from the export's host numbers (after every ``check``)."""

    def end_export(self) -> None:
        """The export is over (also when it raised)."""

    def detach(self) -> None:
        """Remove the family's hooks."""


F = TypeVar("F", bound=MetricFamily)


@dataclass
class BuildContext:
    """What ``PolicyMetrics.attach`` knows when it builds the families, in registration order."""

    cfg: MetricsConfig  #: the metric flags
    model_family: ModelFamily  #: the model family of the config (``adapters``)
    facts: ModelFacts  #: experts, layers, top-k, expert-parallel size, aux-loss source
    config: Any  #: the model's config as built (megatron ``TransformerConfig``, HF config)
    chunks: list[nn.Module]  #: the model chunks attach was given
    vocab_size: int | None  #: ``PolicyMetrics(vocab_size=...)``
    #: the router hooks (None: track_moe_metrics off, or no router on this rank)
    collector: ExpertLoadCollector | None
    #: whether MoE families apply: track_moe_metrics on and MoE layers on some rank (a
    #: megatron pipeline stage without them still joins their collectives, with no collector)
    moe: bool
    built: list[MetricFamily] = field(default_factory=list)  #: the families built so far

    def family(self, kind: type[F]) -> F | None:
        """The family of class ``kind`` built before this one, or None."""
        return next((f for f in self.built if isinstance(f, kind)), None)


#: ``build(context) -> MetricFamily | None``: a family module's one entry point
Build = Callable[[BuildContext], MetricFamily | None]

__all__ = ["Build", "BuildContext", "MetricFamily"]

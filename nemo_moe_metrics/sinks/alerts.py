"""Expert-balance alerts: thresholds from ``logger.alerts`` checked against a step's metrics.

:class:`AlertMonitor` runs on rank 0 inside the sink fan-out (``build_sinks``), so every loop
(SFT, DPO, GRPO, a user's own) gets it by logging through its sink. It reads only the numbers
the step already logs (the ``moe/expert_loads`` table, per-layer keys, the summaries): no
collective, no device read. Each crossing prints one warning line naming the step, the layer
and the expert, and ``moe/alerts`` counts the crossings of the step.

The one path an alert takes, whatever its kind: a check returns :class:`Alert` s; the monitor
logs them (the rank's log) and keeps them as :attr:`AlertMonitor.last_alerts`; the fan-out
hands their :meth:`Alert.record` s to the JSONL sink, which writes them into the step's line
under the reserved field ``"alerts"`` (:data:`ALERTS_FIELD`, after every metric)::

    {"step": 7, ..., "moe/alerts": 1, "alerts": [{"kind": "drift", "layer": 3, "expert": 5,
     "message": "moe alert step 7: layer 3 routing drift JS 0.214 bits since step 6 > ..."}]}

From there ``nemo-moe-metrics run`` prints them on its console (:class:`AlertConsole`: one line
each, rate-limited) and the report summary lists them, so an API user who logs through
``build_sinks`` gets the same. A new kind needs only a check here that returns ``Alert`` s (and
its threshold in ``AlertsConfig``); recording, console and report need no change.

An alert fires when its condition starts to hold and re-arms once it stops holding, so a layer
that stays overloaded for 1,000 steps warns once, not 1,000 times. What each check needs:

- ``max_over_ideal``: the table (layer and expert), else ``moe/layer_{i}/max_over_ideal``
  (layer), else ``moe/max_over_ideal_max`` (the worst layer, unnamed);
- ``dead_steps``, ``drift``: the table (they compare experts across steps);
- ``dropped_fraction``: ``moe/layer_{i}/dropped_fraction`` (layer; the table adds the busiest
  expert, the one at capacity), else ``moe/dropped_fraction`` (all layers together).
- ``routing_disagreement``: ``moe/layer_{i}/routing_disagreement`` (layer), else
  ``moe/routing_disagreement`` (all layers); only steps that log routing consistency.
- ``router_near_tie_fraction``: ``moe/layer_{i}/router_near_tie_fraction`` (layer), else
  ``moe/router_near_tie_fraction_max`` (the worst layer, unnamed); ``router_logit_max_abs``:
  ``moe/layer_{i}/router_logit_max_abs``, else ``moe/router_logit_max_abs``; only steps that
  log router health (``track_router_health``).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nemo_moe_metrics.config import AlertsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.expert_table import ExpertTable
from nemo_moe_metrics.moe.load_over_steps import DeadStreaks, Drift
from nemo_moe_metrics.sinks.jsonl import ALERTS_FIELD  # the reserved field of a JSONL line
from nemo_moe_metrics.sinks.store import table_to_counts_and_widths

log = logging.getLogger("nemo_moe_metrics.alerts")

_LAYER_KEY = re.compile(
    r"^moe/layer_(\d+)/(max_over_ideal|dropped_fraction|routing_disagreement"
    r"|router_near_tie_fraction|router_logit_max_abs)$"
)


@dataclass(frozen=True)
class Alert:
    """One threshold crossing: which check, where (``None`` when the logs cannot say), the line."""

    kind: str
    step: int
    layer: int | None
    expert: int | None
    message: str

    def record(self) -> dict[str, Any]:
        """What metrics.jsonl keeps of it (the step is the line's own)."""
        return {
            "kind": self.kind,
            "layer": self.layer,
            "expert": self.expert,
            "message": self.message,
        }


def _table(table: Any) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Layer ids, counts ``[L, E]`` and each layer's number of experts (layers may differ:
    columns beyond a layer's width are no expert): an :class:`ExpertTable`'s own arrays, or
    from a list of rows (a table built by hand)."""
    if isinstance(table, ExpertTable):
        return table.layer_ids.tolist(), table.counts, table.widths
    layer_ids, counts, widths = table_to_counts_and_widths(table)
    return [int(la) for la in layer_ids], counts, widths


class AlertMonitor:
    """Checks each logged step against ``cfg``'s thresholds and prints one line per crossing."""

    def __init__(self, cfg: AlertsConfig) -> None:
        self.cfg = cfg
        self._streaks = DeadStreaks(cfg.dead_steps) if cfg.dead_steps else None
        self._prev: tuple[int, list[int], np.ndarray] | None = None  # step, layers, counts
        self._drift = Drift()
        self._active: set[tuple[str, int | None]] = set()
        self._noted_no_table = False
        self.last_alerts: list[Alert] = []  #: the crossings of the last observed step

    def observe(self, metrics: Mapping[str, Any], step: int) -> dict[str, int]:
        """Check one step; print its alerts; return ``{moe/alerts: number of crossings}``.

        The crossings stay in :attr:`last_alerts` until the next step (for the JSONL record).
        """
        self.last_alerts = []
        alerts = self.check(metrics, step)
        self.last_alerts = alerts
        self._emit(alerts, step)
        return {mn.ALERTS: len(alerts)}

    def check(self, metrics: Mapping[str, Any], step: int) -> list[Alert]:
        """The crossings of this step, without printing them (state advances)."""
        step = int(step)
        if metrics.get(mn.ROUTED_TOKENS) == 0:
            return []  # no expert received a training token: nothing to judge, state kept
        table = metrics.get(mn.EXPERT_LOADS)
        has_rows = table is not None and len(table) > 0
        layers, counts, widths = _table(table) if has_rows else ([], None, None)
        per_layer: dict[str, dict[int, float]] = {
            "max_over_ideal": {},
            "dropped_fraction": {},
            "routing_disagreement": {},
            "router_near_tie_fraction": {},
            "router_logit_max_abs": {},
        }
        for key, value in metrics.items():
            m = _LAYER_KEY.match(key)
            if m and isinstance(value, int | float) and np.isfinite(value):
                per_layer[m[2]][int(m[1])] = float(value)
        holding: dict[tuple[str, int | None], Alert] = {}
        self._check_max_over_ideal(metrics, step, layers, counts, widths, per_layer, holding)
        self._check_dropped(metrics, step, layers, counts, widths, per_layer, holding)
        self._check_routing(metrics, step, per_layer, holding)
        self._check_router_health(metrics, step, per_layer, holding)
        if counts is not None:
            self._check_drift(step, layers, counts, holding)
        else:
            # A loop that logs the table every N steps: drift and streaks compare the steps
            # that have one (as the report does), so nothing is reset here.
            if self._prev is None:
                self._note_no_table()
        fired = [a for key, a in holding.items() if key not in self._active]
        # Drift is judged on table steps only: a step without a table leaves it as it was.
        kept = {k for k in self._active if k[0] == "drift"} if counts is None else set()
        self._active = set(holding) | kept
        if counts is not None and self._streaks is not None:
            fired += self._check_dead(step, layers, counts, widths)
        return fired

    # -- checks -------------------------------------------------------------------------------

    def _check_max_over_ideal(
        self, metrics, step, layers, counts, widths, per_layer, holding
    ) -> None:
        limit = self.cfg.max_over_ideal
        if limit is None:
            return
        text = f"> logger.alerts.max_over_ideal={limit:g}"
        if counts is not None:
            totals = counts.sum(axis=1)
            for i, layer in enumerate(layers):
                if totals[i] <= 0:
                    continue
                expert = int(counts[i].argmax())
                ratio = float(counts[i, expert] * widths[i] / totals[i])
                if ratio > limit:
                    holding["max_over_ideal", layer] = Alert(
                        "max_over_ideal",
                        step,
                        layer,
                        expert,
                        f"moe alert step {step}: layer {layer} expert {expert} load "
                        f"{ratio:.2f}x ideal {text}",
                    )
        elif per_layer["max_over_ideal"]:
            for layer, ratio in sorted(per_layer["max_over_ideal"].items()):
                if ratio > limit:
                    holding["max_over_ideal", layer] = Alert(
                        "max_over_ideal",
                        step,
                        layer,
                        None,
                        f"moe alert step {step}: layer {layer} busiest expert {ratio:.2f}x ideal "
                        f"{text} (expert unknown: log policy.megatron_cfg.log_expert_table=true)",
                    )
        else:
            ratio = metrics.get(mn.MAX_OVER_IDEAL_MAX)
            if isinstance(ratio, int | float) and ratio > limit:
                holding["max_over_ideal", None] = Alert(
                    "max_over_ideal",
                    step,
                    None,
                    None,
                    f"moe alert step {step}: worst layer's busiest expert {ratio:.2f}x ideal "
                    f"{text} (layer and expert unknown: log "
                    "policy.megatron_cfg.log_expert_table=true)",
                )

    def _check_dropped(self, metrics, step, layers, counts, widths, per_layer, holding) -> None:
        limit = self.cfg.dropped_fraction
        if limit is None:
            return
        text = f"> logger.alerts.dropped_fraction={limit:g}"
        if per_layer["dropped_fraction"]:
            row = {la: i for i, la in enumerate(layers)}
            for layer, frac in sorted(per_layer["dropped_fraction"].items()):
                if frac <= limit:
                    continue
                expert, where = (
                    None,
                    " (expert unknown: log policy.megatron_cfg.log_expert_table=true)",
                )
                if counts is not None and layer in row and counts[row[layer]].sum() > 0:
                    c, width = counts[row[layer]], widths[row[layer]]
                    expert = int(c.argmax())
                    where = (
                        f" (busiest expert {expert} at {c[expert] * width / c.sum():.2f}x ideal, "
                        "at capacity)"
                    )
                holding["dropped_fraction", layer] = Alert(
                    "dropped_fraction",
                    step,
                    layer,
                    expert,
                    f"moe alert step {step}: layer {layer} dropped {frac:.1%} of its top-k "
                    f"choices {text}{where}",
                )
        else:
            frac = metrics.get(mn.DROPPED_FRACTION)
            if isinstance(frac, int | float) and frac > limit:
                holding["dropped_fraction", None] = Alert(
                    "dropped_fraction",
                    step,
                    None,
                    None,
                    f"moe alert step {step}: all MoE layers dropped {frac:.1%} of their top-k "
                    f"choices {text} (layer and expert unknown: log "
                    "policy.megatron_cfg.moe_per_layer_logging=true and log_expert_table=true)",
                )

    def _check_routing(self, metrics, step, per_layer, holding) -> None:
        limit = self.cfg.routing_disagreement
        if limit is None:
            return
        text = f"> logger.alerts.routing_disagreement={limit:g}"
        hint = (
            " (rollout and training routers choose different experts; consider router replay, "
            "policy.megatron_cfg.moe_enable_routing_replay, or matching the rollout precision)"
        )
        if per_layer["routing_disagreement"]:
            for layer, frac in sorted(per_layer["routing_disagreement"].items()):
                if frac > limit:
                    holding["routing_disagreement", layer] = Alert(
                        "routing_disagreement",
                        step,
                        layer,
                        None,
                        f"moe alert step {step}: layer {layer} routing disagreement {frac:.1%} "
                        f"{text}{hint}",
                    )
            return
        frac = metrics.get(mn.ROUTING_DISAGREEMENT)
        if isinstance(frac, int | float) and frac > limit:
            holding["routing_disagreement", None] = Alert(
                "routing_disagreement",
                step,
                None,
                None,
                f"moe alert step {step}: routing disagreement {frac:.1%} over all MoE layers "
                f"{text}{hint}",
            )

    def _check_router_health(self, metrics, step, per_layer, holding) -> None:
        checks = (
            (
                "router_near_tie_fraction",
                self.cfg.router_near_tie_fraction,
                mn.ROUTER_NEAR_TIE_FRACTION_MAX,
                lambda v: f"decides {v:.1%} of its tokens by a near tie",
                " (top-k decisions inside the near-tie gap flip under bf16 rounding: expect "
                "rollout/training routing disagreement; see docs/en/router_health.md)",
            ),
            (
                "router_logit_max_abs",
                self.cfg.router_logit_max_abs,
                mn.ROUTER_LOGIT_MAX_ABS,
                lambda v: f"router logit |z| reached {v:.3g}",
                " (growing router logits precede divergence; consider a z-loss, "
                "moe_z_loss_coeff, or a lower learning rate; see docs/en/router_health.md)",
            ),
        )
        for kind, limit, summary_key, says, hint in checks:
            if limit is None:
                continue
            text = f"> logger.alerts.{kind}={limit:g}"
            if per_layer[kind]:
                for layer, value in sorted(per_layer[kind].items()):
                    if value > limit:
                        holding[kind, layer] = Alert(
                            kind,
                            step,
                            layer,
                            None,
                            f"moe alert step {step}: layer {layer} {says(value)} {text}{hint}",
                        )
                continue
            value = metrics.get(summary_key)
            if isinstance(value, int | float) and value > limit:
                holding[kind, None] = Alert(
                    kind,
                    step,
                    None,
                    None,
                    f"moe alert step {step}: the worst MoE layer {says(value)} {text}{hint} "
                    "(layer unknown: log policy.megatron_cfg.moe_per_layer_logging=true)",
                )

    def _check_drift(self, step, layers, counts, holding) -> None:
        prev, self._prev = self._prev, (step, layers, counts)
        js = self._drift.update(counts)
        limit = self.cfg.drift
        if limit is None or prev is None or prev[1] != layers or prev[2].shape != counts.shape:
            return
        prev_step, _, prev_counts = prev
        for i, layer in enumerate(layers):
            if not js[i] > limit:  # NaN (a layer without tokens) never alerts
                continue
            before = prev_counts[i] / prev_counts[i].sum()
            after = counts[i] / counts[i].sum()
            expert = int(np.abs(after - before).argmax())
            holding["drift", layer] = Alert(
                "drift",
                step,
                layer,
                expert,
                f"moe alert step {step}: layer {layer} routing drift JS {js[i]:.3f} bits since "
                f"step {prev_step} > logger.alerts.drift={limit:g} (expert {expert} moved most: "
                f"{before[expert]:.1%} -> {after[expert]:.1%} of tokens)",
            )

    def _check_dead(self, step, layers, counts, widths) -> list[Alert]:
        assert self._streaks is not None
        length = self._streaks.update(step, layers, counts, widths)
        n = self._streaks.min_steps
        out = []
        for row, expert in zip(*np.nonzero(length == n), strict=True):
            layer = layers[row]
            first = int(self._streaks.first_steps[row, expert])
            out.append(
                Alert(
                    "dead_steps",
                    step,
                    layer,
                    int(expert),
                    f"moe alert step {step}: layer {layer} expert {int(expert)} got no token for "
                    f"{n} logged step(s) (since step {first}) >= logger.alerts.dead_steps={n}",
                )
            )
        return out

    # -- output -------------------------------------------------------------------------------

    def _note_no_table(self) -> None:
        if self._noted_no_table or not (self.cfg.dead_steps or self.cfg.drift):
            return
        self._noted_no_table = True
        log.warning(
            "moe alerts: no %s table in the logged metrics, so the dead-expert and drift alerts "
            "are off; log it with policy.megatron_cfg.log_expert_table=true",
            mn.EXPERT_LOADS,
        )

    def _emit(self, alerts: list[Alert], step: int) -> None:
        shown = alerts[: self.cfg.max_lines_per_step]
        for alert in shown:
            log.warning("%s", alert.message)
        if len(alerts) > len(shown):
            log.warning(
                "moe alert step %d: %d more crossing(s) not shown (%s=%d; "
                "logger.alerts.max_lines_per_step=%d)",
                step,
                len(alerts) - len(shown),
                mn.ALERTS,
                len(alerts),
                self.cfg.max_lines_per_step,
            )


def recorded_alerts(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The alert records of one metrics.jsonl row (empty when none, or not a list of objects)."""
    records = row.get(ALERTS_FIELD)
    if not isinstance(records, list):
        return []
    return [r for r in records if isinstance(r, Mapping) and isinstance(r.get("message"), str)]


class AlertConsole:
    """The alert lines a console shows while a run logs: one line per recorded alert, at most
    ``per_step`` of a step and ``per_window`` in any ``window_s`` seconds; what is held back is
    counted in one line when lines may flow again, and in :meth:`closing_line`."""

    def __init__(
        self,
        *,
        per_step: int = 10,
        per_window: int = 20,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_step = per_step
        self.per_window = per_window
        self.window_s = window_s
        self._clock = clock
        self._shown_at: list[float] = []
        self._held = 0  # alerts not shown since the last line that said so
        self.held_total = 0  #: alerts never shown on this console

    def lines(self, row: Mapping[str, Any]) -> list[str]:
        """The lines to print for one metrics.jsonl row (in step order)."""
        records = recorded_alerts(row)
        now = self._clock()
        self._shown_at = [t for t in self._shown_at if now - t < self.window_s]
        room = self.per_window - len(self._shown_at)
        out: list[str] = []
        if self._held and room > 0:
            out.append(self._held_line())
            room -= 1
        take = max(0, min(len(records), self.per_step, room))
        out += [r["message"] for r in records[:take]]
        room -= take
        rest = len(records) - take
        self.held_total += rest
        if rest and take == self.per_step and room > 0:  # the step's own cap
            out.append(
                f"moe alert step {row.get('step')}: {rest} more alert(s) of this step not shown "
                f"(logger.alerts.max_lines_per_step={self.per_step}); all are in metrics.jsonl"
            )
        elif rest:  # the window is full: said in one line when lines may flow again
            self._held += rest
        self._shown_at += [now] * len(out)
        return out

    def closing_line(self, report_hint: str) -> str | None:
        """One line for the alerts never shown (None when every alert was shown)."""
        if not self.held_total:
            return None
        return (
            f"moe alerts: {self.held_total} alert line(s) not shown here (rate limit); every "
            f"alert is in metrics.jsonl (field {ALERTS_FIELD!r}) and in {report_hint}"
        )

    def _held_line(self) -> str:
        held, self._held = self._held, 0
        return (
            f"moe alerts: {held} more alert(s) not shown (at most {self.per_window} lines per "
            f"{self.window_s:g} s and {self.per_step} per step); all are in metrics.jsonl"
        )


def summarize_alerts(rows: Sequence[tuple[int, list[dict[str, Any]]]], limit: int = 5) -> list[str]:
    """Report lines for ``(step, alert records)`` pairs of a run: counts by kind, then the first
    ``limit`` alert lines (each line already names its step)."""
    total = sum(len(records) for _, records in rows)
    if not total:
        return []
    kinds: dict[str, int] = {}
    for _, records in rows:
        for r in records:
            kinds[str(r.get("kind"))] = kinds.get(str(r.get("kind")), 0) + 1
    steps = [step for step, records in rows if records]
    span = f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} steps, {steps[0]}–{steps[-1]}"
    by_kind = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    out = [f"alerts (logger.alerts): {total} in {span}; by kind: {by_kind}"]
    messages = [r["message"] for _, records in rows for r in records]
    out += [f"  {m}" for m in messages[:limit]]
    if total > limit:
        out.append(
            f"  ... {total - limit} more (every alert is in metrics.jsonl, field {ALERTS_FIELD!r})"
        )
    return out

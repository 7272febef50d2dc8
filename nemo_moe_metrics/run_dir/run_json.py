"""``run.json``: a run's identity (name, id, when made and resumed) and its model's MoE shape.

Every writer of a run directory makes it through :func:`run_metadata`, so the shape the report
and ``placement`` read sits at the top level whatever wrote the run (the main job, the Trainer
callback, Megatron-Bridge, torchtitan, a Ray driver): ``num_layers``, ``num_experts``,
``moe_router_topk`` and ``ep_size``, each None when unknown. ``config`` keeps what the writer
passed (a recipe's whole dump, or an integration's own settings); ``expert_tables`` is set
once the run logged its first expert-load table.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nemo_moe_metrics.adapters.family import ModelFacts
from nemo_moe_metrics.run_dir.names import RUN_FILE
from nemo_moe_metrics.runtime.durable import write_text_durably

#: The model shape at the top level of every ``run.json``.
SHAPE_KEYS = ("num_layers", "num_experts", "moe_router_topk", "ep_size")
#: True once the run logged an expert-load table (set by the run's session at its first one):
#: a run whose store holds no step yet is one killed before its cadence, not one without tables.
TABLES_LOGGED = "expert_tables"


def now() -> str:
    """This moment, as ``run.json`` writes times (UTC, seconds)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_metadata(
    run_name: str, config: dict[str, Any] | None, facts: ModelFacts | None = None
) -> dict[str, Any]:
    """What ``run.json`` holds: the run name, the model's MoE shape, the config.

    The shape comes from ``facts`` (what ``PolicyMetrics.attach`` read from the model) when
    given, else from a recipe's ``policy.model`` and ``policy.megatron_cfg``.
    """
    policy = (config or {}).get("policy") or {}
    model = policy.get("model") or {}
    parallel = policy.get("megatron_cfg") or {}
    shape = {
        "num_layers": model.get("num_layers"),
        "num_experts": model.get("num_experts"),
        "moe_router_topk": model.get("moe_router_topk"),
        "ep_size": parallel.get("expert_model_parallel_size"),
    }
    if facts is not None:
        known = {
            "num_layers": facts.num_layers or None,
            "num_experts": facts.num_experts or None,
            "moe_router_topk": facts.topk,
            "ep_size": facts.ep_size,
        }
        shape.update({key: value for key, value in known.items() if value is not None})
    return {"run_name": run_name, "created": now(), **shape, "config": config or {}}


def read_run_json(run_dir: Path) -> dict[str, Any]:
    """``run_dir``'s ``run.json`` as a dict; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads((Path(run_dir) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_run_json(run_dir: Path, meta: dict[str, Any]) -> None:
    """Write ``run.json`` whole or not at all (write-then-rename, fsync'd)."""
    write_text_durably(Path(run_dir) / RUN_FILE, json.dumps(meta, indent=2, default=str))


__all__ = ["SHAPE_KEYS", "TABLES_LOGGED", "now", "read_run_json", "run_metadata", "write_run_json"]

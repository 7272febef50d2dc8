"""A key given in the wrong section is suggested with its section, through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_first_hour_messages import first_hour_cli

pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


@pytest.mark.parametrize(
    "override,suggested",
    [
        ("track_router_health=false", "policy.megatron_cfg.track_router_health"),
        ("policy.track_router_health=false", "policy.megatron_cfg.track_router_health"),
        ("table_every=5", "logger.table_every"),
        ("num_experts=16", "policy.model.num_experts"),
        ("track_router_healt=false", "policy.megatron_cfg.track_router_health"),
    ],
)
def test_an_override_without_its_section_is_suggested_with_it(override, suggested):
    proc = first_hour_cli("check", str(GRPO), override)
    assert proc.returncode == 2
    assert (
        f"override '{override}': unknown key '{override.split('=')[0].split('.')[-1]}'; "
        f"did you mean '{suggested}'?" in proc.stderr
    ), proc.stderr
    # ...and the suggestion is a key the recipe accepts.
    value = override.split("=")[1]
    assert first_hour_cli("check", str(GRPO), f"{suggested}={value}").returncode == 0

import os
import sys

import pytest

# Tests import helpers (tests/dist.py) by module name, in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module that touches megatron-core (imports it, builds the reference
    worker or a megatron config) with ``megatron``: CI runs ``-m megatron`` on both supported
    megatron-core lines (.ci/run)."""
    touches: dict = {}
    for item in items:
        path = item.path
        if path not in touches:
            touches[path] = "megatron" in path.read_text(encoding="utf-8")
        if touches[path]:
            item.add_marker(pytest.mark.megatron)

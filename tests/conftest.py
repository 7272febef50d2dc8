import os
import sys

# Tests import helpers (tests/dist.py) by module name, in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

"""Launch a recipe on local torchrun ranks through nemo-run (CPU with gloo, or local GPUs).

    python recipes/local_torchrun.py examples/configs/grpo_moe_tiny.yaml --nproc 2 \
        policy.megatron_cfg.moe_per_layer_logging=true

Same as ``nemo-moe-metrics run`` without the progress bar: nemo-run's own console output.
The run lands in ``<output-dir>/<recipe name>/`` (``metrics.jsonl``, ``recipe.yaml``, and
nemo-run's state under ``nemo_run/``, so nothing is written to the home directory).
"""

import sys

from nemo_moe_metrics.launch import main

if __name__ == "__main__":
    # The executor and script are built in nemo_moe_metrics.launch (local_executor,
    # train_script, launch_local): run.LocalExecutor(ntasks_per_node=N, launcher="torchrun").
    sys.exit(main())

"""Train a tiny random-init torchtitan MoE model on 2 ranks (FSDP2 as torchtitan applies it).

Run it (CPU: gloo; GPU: nccl, one device per rank)::

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 einops==0.8.2 && pip install tyro==1.0.17 triton==3.7.1
    torchrun --nproc-per-node 2 examples/integrate_torchtitan.py --out /tmp/titan_run
    torchrun --nproc-per-node 2 examples/integrate_torchtitan.py --family qwen3_moe --out ...

The model is torchtitan 0.3.0's own DeepSeek-V3 (or Qwen3 MoE) code, built tiny from its layer
builders; torchtitan's own ``parallelize_deepseekv3`` / ``parallelize_qwen3`` shards it with
FSDP2 (``fully_shard`` per block), and torchtitan's optimizer pre-hook moves the aux-loss-free
expert bias. The metric calls are the ones marked ``# (metrics)``. At the end rank 0 prints the
run's report (``nemo-moe-metrics report``), which draws the expert bias next to the load.
On a CPU the flex attention (no backward there) is swapped for torchtitan's SDPA attention.
"""  # noqa: E501 (the install line above is copied as is; tests/project/test_install_lines.py)

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_metrics import PolicyMetrics, build_sinks, model_facts
from nemo_moe_metrics.config import LoggerConfig, MetricsConfig
from nemo_moe_metrics.runtime.extras import require
from nemo_moe_metrics.runtime.scripts import check_torchrun_script

BATCH, SEQ = 2, 32


def parallelize(model: Any, family: str, world: int) -> tuple[Any, Any]:
    """torchtitan's own parallelize function for the family: FSDP2 over ``world`` ranks."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3 as fn
    else:
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3 as fn
    fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="",
    )
    if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM: plain sums, then scaling
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model, dims


def run(out_dir: Path, *, family: str = "deepseek_v3", steps: int = 3) -> list[dict[str, Any]]:
    """Everything a rank does; torch.distributed must already be initialised."""
    require("torchtitan", "torchtitan", "examples/integrate_torchtitan.py")
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    from nemo_moe_metrics.integrations.torchtitan import (
        build_model,
        tiny_config,
        use_cpu_device_mesh,
        use_sdpa_attention,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    use_cpu_device_mesh()
    config = tiny_config(family)
    if not cuda:
        use_sdpa_attention(config)
    # First: a run directory another writer holds is refused before any model is built.
    sink = build_sinks(  # (metrics) JSONL + expert-load store under out_dir, rank 0 only
        # table_every=1: every step's expert-load table for this short demo (long runs: 20)
        LoggerConfig(wandb_enabled=False, tensorboard_enabled=False, table_every=1),
        out_dir,
        run_name=f"integrate_torchtitan_{family}",
        config={"torchtitan": {"family": family}},
        facts=model_facts(config),  # run.json: the model's layers, experts, top-k
        rank=rank,
    )
    model = build_model(config, device=device, seed=0)  # the same weights on every rank
    metrics = PolicyMetrics(  # (metrics) the flags
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=True,
            track_throughput=True,
            track_flops=True,
        )
    )
    metrics.attach(model, config)  # (metrics) before sharding: hooks survive fully_shard
    model, dims = parallelize(model, family, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    register_moe_load_balancing_hook(optimizer, [model], dims)  # torchtitan's bias update
    history = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g).to(device)
        with metrics.step():  # (metrics) times the optimizer step
            metrics.microbatch(seq_lens=torch.full((BATCH,), SEQ))  # (metrics) tokens
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten()
            )
            loss.backward()
            optimizer.step()  # torchtitan's pre-hook moves expert_bias_E first
            optimizer.zero_grad()
        step_metrics = metrics.finish_step(num_microbatches=1)  # (metrics) every rank
        sink.log(step_metrics, step)
        history.append(step_metrics)
    sink.close()
    return history


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (metrics.jsonl)")
    parser.add_argument("--family", choices=["deepseek_v3", "qwen3_moe"], default="deepseek_v3")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    check_torchrun_script(  # one line, before any rank starts talking
        "examples/integrate_torchtitan.py",
        extras=[("torchtitan", "examples/integrate_torchtitan.py")],
    )
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        history = run(args.out, family=args.family, steps=args.steps)
        if dist.get_rank() == 0:
            from nemo_moe_metrics.report import render_report

            last = history[-1]
            print(
                f"step {len(history) - 1}: moe/max_over_ideal {last['moe/max_over_ideal']:.3f}, "
                f"moe/expert_bias_range {last['moe/expert_bias_range']:.4f}, "
                f"train_perf/tokens {last['train_perf/tokens']:.0f}"
            )
            print(render_report(args.out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

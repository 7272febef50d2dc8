"""Train a tiny random-init Hugging Face MoE model on 2 ranks (FSDP2) with PolicyMetrics.

Run it (CPU: gloo; GPU: nccl, one device per rank)::

    torchrun --nproc-per-node 2 examples/integrate_hf_fsdp.py --out /tmp/hf_fsdp_run
    nemo-moe-metrics report /tmp/hf_fsdp_run

``--wrap ddp`` uses DistributedDataParallel instead of FSDP2 (``fully_shard``); ``--wrap none``
trains each rank's copy alone (plain PyTorch). The metric calls are the ones marked
``# (metrics)``; everything else is an ordinary transformers + FSDP2 training loop.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_moe_metrics import PolicyMetrics, Sink, build_sinks
from nemo_moe_metrics.config import LoggerConfig, MetricsConfig

VOCAB = 128


def tiny_config() -> Any:
    """A 2-layer qwen3_moe config, 8 experts, top-2 (random init, nothing downloaded)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=128, router_aux_loss_coef=0.01, output_router_logits=True,
        attn_implementation="eager",
    )  # fmt: skip
    config._experts_implementation = "eager"  # the per-expert loop (grouped_mm is GPU-oriented)
    return config


def build_model(config: Any, wrap: str, device: torch.device) -> nn.Module:
    """Random-init causal LM, same weights on every rank, wrapped as ``wrap`` says."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device).train()
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    return model


def microbatches(rank: int, step: int, n: int, device: torch.device, batch: int = 2, seq: int = 16):
    """``n`` microbatches of this rank: token ids and an attention mask (1 = real token)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq - int(torch.randint(0, seq // 2, (1,), generator=g)) :] = 0  # right padding
        yield ids.to(device), mask.to(device)


def train(
    model: nn.Module,
    config: Any,
    metrics: PolicyMetrics,
    sink: Sink,
    *,
    rank: int,
    steps: int,
    num_microbatches: int,
    device: torch.device,
) -> list[dict[str, Any]]:
    """The training loop; returns each step's metrics (the same dict on every rank)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = []
    for step in range(steps):
        with metrics.step():  # (metrics) times the optimizer step
            for ids, mask in microbatches(rank, step, num_microbatches, device):
                metrics.microbatch(seq_lens=mask.sum(-1))  # (metrics) real tokens per sequence
                labels = ids.masked_fill(mask == 0, -100)
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
                (out.loss / num_microbatches).backward()
            optimizer.step()
            optimizer.zero_grad()
        step_metrics = metrics.finish_step(num_microbatches=num_microbatches)  # (metrics) all ranks
        sink.log(step_metrics, step)  # rank 0 writes; the others hold a NullSink
        history.append(step_metrics)
    sink.close()
    return history


def run(out_dir: Path, *, wrap: str = "fsdp", steps: int = 3, num_microbatches: int = 2) -> list:
    """Everything a rank does; torch.distributed must already be initialised."""
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    config = tiny_config()
    model = build_model(config, wrap, device)
    metrics = PolicyMetrics(  # (metrics) the flags; HF configs carry vocab_size themselves
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=True,
            track_throughput=True,
            track_flops=True,  # MFU too on a GPU the peak table knows (none on CPU)
        )
    )
    metrics.attach(model, config)  # (metrics) hooks the routers; config picks the adapter
    sink = build_sinks(  # (metrics) JSONL + TensorBoard under out_dir, rank 0 only
        # table_every=1: every step's expert-load table for this short demo (long runs: 20)
        LoggerConfig(wandb_enabled=False, table_every=1),
        out_dir,
        run_name="integrate_hf_fsdp",
        facts=metrics.facts,  # run.json: the model's layers, experts, top-k
        rank=rank,
    )
    return train(
        model,
        config,
        metrics,
        sink,
        rank=rank,
        steps=steps,
        num_microbatches=num_microbatches,
        device=device,
    )


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (metrics.jsonl)")
    parser.add_argument("--wrap", choices=["fsdp", "ddp", "none"], default="fsdp")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    from nemo_moe_metrics.runtime.scripts import check_torchrun_script

    check_torchrun_script(  # one line, before any rank starts talking
        "examples/integrate_hf_fsdp.py", extras=[("hf", "examples/integrate_hf_fsdp.py")]
    )
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        history = run(args.out, wrap=args.wrap, steps=args.steps)
        if dist.get_rank() == 0:
            last = history[-1]
            print(
                f"step {len(history) - 1}: moe/load_balancing_loss "
                f"{last['moe/load_balancing_loss']:.4f}, moe/max_over_ideal "
                f"{last['moe/max_over_ideal']:.3f}, train_perf/tokens "
                f"{last['train_perf/tokens']:.0f}"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Your own megatron-core worker with PolicyMetrics: a tiny MoE GPT, a few steps, a report.

Run it (1 or more ranks; CPU uses gloo, GPU nccl)::

    torchrun --nproc-per-node 2 examples/integrate_megatron.py --out /tmp/mcore_run
    nemo-moe-metrics report /tmp/mcore_run      # (this script also prints the report)

The model is built with megatron-core's own APIs (TransformerConfig, GPTModel,
get_gpt_layer_local_spec) and trained with megatron-core's ``get_forward_backward_func``.
Lines marked ``# (metrics)`` are the integration (docs/en/integration.md walks through them).
Lines marked ``# cpu-only`` exist only because a machine without a GPU runs this: on a GPU
they are no-ops (``apply_cpu_shims``, ``cpu_device_mode``) or can go (the CPU settings).
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_moe_metrics import PolicyMetrics, build_sinks
from nemo_moe_metrics.config import DEFAULT_TABLE_EVERY, LoggerConfig, MetricsConfig
from nemo_moe_metrics.megatron.cpu_shims import apply_cpu_shims, cpu_device_mode
from nemo_moe_metrics.runtime.scripts import check_torchrun_script

VOCAB = 128  # the size of the model's output layer: the vocab_size PolicyMetrics needs
SEQ, MICRO_BATCH = 32, 2
NUM_LAYERS, NUM_EXPERTS, TOPK = 2, 8, 2


def transformer_config(expert_parallel: int = 1) -> Any:
    """The megatron-core TransformerConfig of a tiny MoE GPT (every layer MoE)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=32,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
        moe_grouped_gemm=False, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        expert_model_parallel_size=expert_parallel,
        use_cpu_initialization=not gpu,  # cpu-only
        # cpu-only: alltoall needs CUDA
        moe_token_dispatcher_type="alltoall" if gpu else "allgather",
    )  # fmt: skip


def build_model(config: Any) -> torch.nn.Module:
    """megatron-core's GPTModel with the local (non-Transformer-Engine) MoE layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=NUM_EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm"
        ),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    return model.cuda() if torch.cuda.is_available() else model


def microbatches(rank: int, step: int, n: int) -> list[dict[str, torch.Tensor]]:
    """This rank's ``n`` microbatches: tokens, labels and padding_mask (True = padding)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        real = torch.randint(SEQ // 2, SEQ + 1, (MICRO_BATCH,), generator=g)  # right padding
        padding_mask = torch.arange(SEQ).unsqueeze(0) >= real.unsqueeze(1)
        out.append(
            {"tokens": tokens, "labels": tokens.roll(-1, dims=1), "padding_mask": padding_mask}
        )
    return out


def forward_step(metrics: PolicyMetrics, data_iterator, model):
    """megatron-core's forward_step_func: one microbatch forward, and its loss function."""
    device = next(model.parameters()).device
    mb = {k: v.to(device) for k, v in next(data_iterator).items()}
    metrics.microbatch(seq_lens=(~mb["padding_mask"]).sum(-1))  # (metrics) real tokens/sequence
    b, s = mb["tokens"].shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    # cpu-only: an explicit causal mask (True = masked); megatron's default is built on "cuda".
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1).view(1, 1, s, s)
    per_token = model(
        mb["tokens"], position_ids, causal, labels=mb["labels"], padding_mask=mb["padding_mask"]
    )
    keep = (~mb["padding_mask"]).float()

    def loss_func(output: torch.Tensor):
        loss = (output * keep).sum() / keep.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return per_token, loss_func


def sync_grads(model: torch.nn.Module) -> None:
    """Average gradients as megatron's DDP would: dense over DP, experts over expert-DP."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_group()
    edp = ps.get_expert_data_parallel_group()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        group = edp if not getattr(p, "allreduce", True) else dp
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dist.get_world_size(group))


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (metrics.jsonl)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument(
        "--table-every",
        type=int,
        default=1,
        help="store the expert-load table every N steps: every step for this short demo (the "
        "report's over-steps and drift pictures need 2 or more); long runs keep the default "
        f"{DEFAULT_TABLE_EVERY} of LoggerConfig(table_every=...)",
    )
    args = parser.parse_args(argv)
    check_torchrun_script(  # one line, before any rank starts talking
        "examples/integrate_megatron.py", extras=[("megatron", "examples/integrate_megatron.py")]
    )

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    apply_cpu_shims()  # cpu-only (a no-op when CUDA is available)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.expert_parallel)
    torch.manual_seed(1234)
    rank = dist.get_rank()

    config = transformer_config(args.expert_parallel)
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    metrics = PolicyMetrics(  # (metrics)
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=True,
            track_throughput=True,
            track_flops=True,
        ),
        vocab_size=VOCAB,  # megatron's TransformerConfig has no vocab size: the output layer's
    )
    metrics.attach(model, config)  # (metrics) once, after the model is built
    sink = build_sinks(  # (metrics) JSONL + TensorBoard under --out; rank 0 writes
        LoggerConfig(wandb_enabled=False, table_every=args.table_every),
        args.out,
        run_name="integrate_megatron",
        facts=metrics.facts,  # run.json: layers, experts, top-k, EP size (report, placement)
        rank=rank,
    )

    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        with metrics.step():  # (metrics) one optimizer step
            with cpu_device_mode():  # cpu-only: megatron's schedules allocate on "cuda"
                get_forward_backward_func()(
                    forward_step_func=partial(forward_step, metrics),
                    data_iterator=iter(microbatches(rank, step, args.microbatches)),
                    model=model,
                    num_microbatches=args.microbatches,
                    seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH,
                    forward_only=False,
                )
            sync_grads(model)
            optimizer.step()
        step_metrics = metrics.finish_step(
            num_microbatches=args.microbatches
        )  # (metrics) all ranks
        sink.log(step_metrics, step)  # (metrics)
    sink.close()

    if rank == 0:
        from nemo_moe_metrics.report import render_report

        print(render_report(args.out))  # heatmap + max/ideal PNGs and a summary
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Megatron-Bridge's callback API with MoEMetricsCallback, on CPU ranks, Bridge not installed.

Run it (2 CPU ranks, expert parallel 2)::

    torchrun --nproc-per-node 2 examples/integrate_megatron_bridge.py --out /tmp/bridge_run

In a real Bridge training script the integration is two lines (docs/en/frameworks.md)::

    callback = MoEMetricsCallback(MetricsConfig(track_moe_metrics=True, track_throughput=True))
    pretrain(config, callback.wrap_forward_step(forward_step), callbacks=[callback])

Bridge's ``pretrain()`` does not install or run on a CPU machine, so this script plays the part
of Bridge's ``train()`` with the pieces that do run here: Bridge's own ``callbacks.py`` (the
installed package's, else the megatron-bridge 0.6.2 wheel's, fetched once from the package
registry into the user's cache folder and loaded alone by file path, exactly as the tests
do: ``nemo_moe_metrics.testing.load_bridge_callbacks``), a real megatron-core GPT model with MoE
layers, megatron's ``get_forward_backward_func`` and rerun state machine, and megatron's own
aux-loss report called the way Bridge's ``training_log`` calls it. Events fire in Bridge's
order. The last rank holds the writers, as in Bridge; it prints megatron's report beside ours.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

SEQ, MICRO_BATCH = 32, 2


def bridge_callbacks():
    """Bridge's callbacks module: the installed one, else the wheel's file loaded by path."""
    if importlib.util.find_spec("megatron.bridge") is not None:
        from megatron.bridge.training import callbacks

        return callbacks
    from nemo_moe_metrics.testing import load_bridge_callbacks

    return load_bridge_callbacks()


class PrintingWriter:
    """Stands in for Bridge's ``state.tensorboard_logger``: keeps the last value per tag."""

    def __init__(self) -> None:
        self.scalars: dict[tuple[str, int], float] = {}

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.scalars[(tag, int(step))] = float(value)


def forward_step(state, data_iterator, model, return_schedule_plan=False):
    """A Bridge-style forward step (Bridge's gpt_step.forward_step has this signature)."""
    from nemo_moe_metrics.megatron.model import causal_attention_mask

    batch = next(data_iterator)
    b, s = batch["tokens"].shape
    position_ids = torch.arange(s).expand(b, s)
    output = model(batch["tokens"], position_ids, causal_attention_mask(s), labels=batch["labels"])
    loss_mask = batch["loss_mask"]

    def loss_func(output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def batches(dp_rank: int, step: int, n: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """``n`` right-padded microbatches: tokens, labels and loss_mask (what Bridge's get_batch
    hands the forward step)."""
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=gen)
        real = torch.randint(SEQ // 2, SEQ + 1, (MICRO_BATCH,), generator=gen)
        loss_mask = (torch.arange(SEQ).unsqueeze(0) < real.unsqueeze(1)).float()
        out.append({"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": loss_mask})
    return out


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (expert store)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--expert-parallel", type=int, default=2)
    args = parser.parse_args(argv)
    from nemo_moe_metrics.runtime.scripts import check_torchrun_script

    check_torchrun_script(  # one line, before any rank starts talking
        "examples/integrate_megatron_bridge.py",
        extras=[("megatron", "examples/integrate_megatron_bridge.py")],
    )

    callbacks = bridge_callbacks()  # before the integration is imported
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        get_num_microbatches,
        init_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

    from nemo_moe_metrics.config import MegatronConfig, MetricsConfig, ModelConfig
    from nemo_moe_metrics.integrations.megatron_bridge import MoEMetricsCallback
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names

    # --- what Bridge's setup does: model, parallel state, microbatch calculator ------------
    layout = MegatronConfig(expert_model_parallel_size=args.expert_parallel)
    model_cfg = ModelConfig(num_layers=2, moe_z_loss_coeff=1e-3, seq_length=SEQ, vocab_size=128)
    init_distributed(layout)  # gloo on CPU, with megatron's CPU shims
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    init_num_microbatches_calculator(
        rank, None, MICRO_BATCH * args.microbatches * dp, MICRO_BATCH, dp
    )
    model = build_gpt_model(model_cfg, layout)
    config = build_transformer_config(model_cfg, layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    last = rank == world - 1
    writer = PrintingWriter() if last else None  # Bridge: writers on the last rank only
    state = SimpleNamespace(  # the parts of Bridge's GlobalState the callback reads
        cfg=SimpleNamespace(
            model=SimpleNamespace(
                vocab_size=100,  # unpadded, as Bridge keeps it; 128 after padding
                should_pad_vocab=True,
                make_vocab_size_divisible_by=128,
                tensor_model_parallel_size=1,
            ),
            logger=SimpleNamespace(tensorboard_dir=None),
        ),
        train_state=SimpleNamespace(step=0),
        tensorboard_logger=writer,
        wandb_logger=None,
    )

    # --- the integration: these two lines go into a real Bridge script ---------------------
    callback = MoEMetricsCallback(
        MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True),
        run_dir=args.out,
        table_every=1,
    )
    step_func = callback.wrap_forward_step(forward_step)

    # --- Bridge's train(): events in its order ----------------------------------------------
    manager = callbacks.normalize_callbacks([callback])
    context = functools.partial(
        callbacks.CallbackContext, state=state, model=[model], user_state=manager.user_state
    )
    manager.fire("on_train_start", context(optimizer=optimizer))
    for step in range(args.steps):
        manager.fire("on_train_step_start", context(optimizer=optimizer))
        data = RerunDataIterator(
            iter(batches(parallel_state.get_data_parallel_rank(), step, args.microbatches, 128))
        )
        with cpu_device_mode():  # cpu-only: megatron's schedules allocate on "cuda"
            while get_rerun_state_machine().should_run_forward_backward(data):
                optimizer.zero_grad()
                get_forward_backward_func()(
                    forward_step_func=functools.partial(step_func, state),
                    data_iterator=data,
                    model=[model],
                    num_microbatches=get_num_microbatches(),
                    seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH,
                    forward_only=False,
                )
        optimizer.step()  # (a real run also averages gradients over data parallel)
        manager.fire("on_train_step_end", context(optimizer=optimizer, skipped_iter=False))
        state.train_state.step += 1
        # training_log: megatron's own aux-loss report, as Bridge calls it every iteration
        compat.megatron_report(
            config,
            loss_scale=1 / get_num_microbatches(),
            iteration=state.train_state.step,
            track_names=tracked_aux_loss_names(config),
            writer=writer,
            total_loss_dict={},
            per_layer=True,
        )
    manager.fire("on_train_end", context(optimizer=optimizer))

    if last:
        it = state.train_state.step
        print(f"iteration {it}: megatron's training_log report vs MoEMetricsCallback")
        for name in tracked_aux_loss_names(config):
            theirs = writer.scalars[(name, it)]
            ours = writer.scalars[(f"moe/{name}", it)]
            print(f"  {name:<22} megatron {theirs:.6f}   ours moe/{name} {ours:.6f}")
        for key in ("moe/max_over_ideal", "moe/max_over_ideal_max", "train_perf/tokens"):
            print(f"  {key:<30} {writer.scalars[(key, it)]:.4f}")
        print(f"expert loads stored in {args.out / 'expert_loads.bin'}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

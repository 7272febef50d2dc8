"""``trl_callback_overhead_ratio``: an SFT step with MoEMetricsCallback over the same step without.

TRL's ``SFTTrainer`` on a random Qwen3-MoE built from a config (4 layers, 8 experts, top-2,
hidden 128; one thread; a step of at least 100 ms on a CPU), gradient accumulation 2, padded
batches, ``logging_steps=1`` (an export every step, the callback's worst case) and every flag on
(``moe_per_layer_logging``, throughput, FLOPs, router health). Two trainers, one with the
callback and one without, train in alternating blocks of steps; a step's time is the interval
between two ``on_step_begin`` calls (forward, backward, optimizer, the export and the Trainer's
logging; the console printer is removed from both, it would time printing); the ratio is the median "with" step over the median "without" step.
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import timed_call, wrap_package_hooks

_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "integrate_trl.py"
#: the benchmark model: a step of >= 100 ms on one CPU thread
_MODEL = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
)  # fmt: skip


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("integrate_trl", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: every flag the callback has: the benchmark's "on" trainer
ALL_FLAGS = dict(
    track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True,
    track_flops=True, track_router_health=True,
)  # fmt: skip


def trl_bench(
    blocks: int = 6,
    steps_per_block: int = 4,
    model: dict[str, Any] | None = None,
    flags: dict[str, bool] | None = None,
) -> dict[str, Any]:
    """Time ``blocks`` alternating blocks of each trainer; returns the ratio and its details.

    ``model``: config fields of the benchmark model (default: a step of >= 100 ms; ``{}``: the
    example's tiny model, to test the harness); ``flags``: the callback's ``MetricsConfig``
    fields (default :data:`ALL_FLAGS`; a subset attributes the cost)."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback

    example = _example()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = random.Random(0)
    texts = [
        " ".join(rng.choice(example.WORDS) for _ in range(rng.randint(60, 120))) for _ in range(64)
    ]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begins: list[float] = []
            self.intervals: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.begins = []

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.begins:
                self.intervals.append(now - self.begins[-1])
            self.begins.append(now)

    class OwnTime(TrainerCallback):
        """The callback's own CPU time: its events but the train's first and last (attach,
        detach), and the package's forward hooks on the model (wrapped while it trains)."""

        def __init__(self) -> None:
            self.spent, self.steps = [0.0], 0
            self._restore: Any = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._restore, _ = wrap_package_hooks(model, self.spent, clock=time.process_time)

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1

        def on_train_end(self, args, state, control, **kwargs):
            self._restore()

    config = MetricsConfig(**(ALL_FLAGS if flags is None else flags))
    own = OwnTime()
    clocks = {"on": StepClock(), "off": StepClock()}
    try:
        with tempfile.TemporaryDirectory(prefix="nmm_trl_bench_") as work:
            fields = _MODEL if model is None else model
            model_dir = example.save_tiny_model(Path(work) / "model", **fields)
            trainers = {}
            for name in ("on", "off"):
                callbacks: list[Any] = [clocks[name]]
                if name == "on":  # OwnTime after the callback: it wraps the hooks attached
                    callback = MoEMetricsCallback(config)
                    for event in ("on_step_begin", "on_step_end", "on_substep_end", "on_log"):
                        setattr(callback, event, timed_call(getattr(callback, event), own.spent,
                                                        time.process_time))  # fmt: skip
                    callbacks += [callback, own]
                trainer = example.build_trainer(
                    "sft", model_dir, Path(work) / name, callbacks,
                    max_steps=steps_per_block + 1, per_device_train_batch_size=4,
                )  # fmt: skip
                # The console printer would time printing the extra keys, not the metrics.
                trainer.remove_callback(PrinterCallback)
                trainers[name] = trainer
            for trainer in trainers.values():
                data = Dataset.from_list([{"text": t} for t in texts])
                trainer.train_dataset = trainer._prepare_dataset(
                    data, trainer.processing_class, trainer.args, False, None, "train"
                )
            for block in range(blocks):
                order = ("on", "off") if block % 2 == 0 else ("off", "on")
                for name in order:
                    trainers[name].train()
    finally:
        torch.set_num_threads(threads)
    on, off = clocks["on"].intervals, clocks["off"].intervals
    ratio = statistics.median(on) / statistics.median(off)
    own_ms = 1e3 * own.spent[0] / max(own.steps, 1)
    return {
        "trl_callback_overhead_ratio": ratio,
        # the callback's own CPU time per step (events and hooks), and 1 + it / the off step
        "callback_cpu_ms_per_step": own_ms,
        "callback_cpu_ratio": 1.0 + own_ms / (1e3 * statistics.median(off)),
        "step_ms_on_median": 1e3 * statistics.median(on),
        "step_ms_off_median": 1e3 * statistics.median(off),
        "steps": len(on),
        "blocks": blocks,
        "model": dict(_MODEL if model is None else model),
    }


if __name__ == "__main__":
    print(trl_bench(blocks=2, steps_per_block=3))

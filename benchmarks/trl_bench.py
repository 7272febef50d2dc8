"""``trl_callback_overhead_ratio``: SFT steps with MoEMetricsCallback over the same steps without.

TRL's ``SFTTrainer`` on a random Qwen3-MoE built from a config (4 layers, 8 experts, top-2,
hidden 128; one thread; a step of at least 100 ms on a CPU), gradient accumulation 2, padded
batches, every flag on (``moe_per_layer_logging``, throughput, FLOPs, router health) and TRL's
own default ``logging_steps`` (``SFTConfig``'s: 10), so one step in ``logging_steps`` exports.
Two trainers, one with the callback and one without, train in alternating blocks of whole
logging windows; a step's time is the interval between two ``on_step_begin`` calls (forward,
backward, optimizer, and on a logging step the export and the Trainer's logging; the console
printer is removed from both, it would time printing).

A window's time is ``(logging_steps - 1) x`` the median step that does not log ``+`` the median
step that logs, per trainer (medians: robust to a burst of other load; the weighting: what a
window costs). ``trl_callback_overhead_ratio`` is the "with" window over the "without" one.
``log_step_ratio`` (the median logging step with over without) is the cost of a step when every
step logs (``logging_steps=1``): the export of a window costs the same whatever its steps.
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


def default_logging_steps() -> int:
    """TRL's own default ``logging_steps`` for SFT (``SFTConfig``'s; the Trainer's is 500)."""
    from trl import SFTConfig

    return int(SFTConfig.__dataclass_fields__["logging_steps"].default)


def trl_bench(
    blocks: int = 4,
    windows_per_block: int = 2,
    model: dict[str, Any] | None = None,
    flags: dict[str, bool] | None = None,
    logging_steps: int | None = None,
) -> dict[str, Any]:
    """Time ``blocks`` alternating blocks of each trainer, ``windows_per_block`` logging windows
    each; returns the ratio and its details.

    ``model``: config fields of the benchmark model (default: a step of >= 100 ms; ``{}``: the
    example's tiny model, to test the harness); ``flags``: the callback's ``MetricsConfig``
    fields (default :data:`ALL_FLAGS`; a subset attributes the cost); ``logging_steps``: default
    :func:`default_logging_steps`."""
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

    window = default_logging_steps() if logging_steps is None else logging_steps
    if window < 2:
        raise ValueError(f"logging_steps={window}: a window needs a step that does not log")

    class StepClock(TrainerCallback):
        """Step intervals, apart for the steps that log and those that do not."""

        def __init__(self) -> None:
            self.begin: float | None = None
            self.logging: list[float] = []
            self.quiet: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = None

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.begin is not None:  # the step that ended is global_step (it logged if % W)
                logged = state.global_step % window == 0
                (self.logging if logged else self.quiet).append(now - self.begin)
            self.begin = now

        def window_s(self) -> float:
            return (window - 1) * statistics.median(self.quiet) + statistics.median(self.logging)

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
                    max_steps=windows_per_block * window + 1, logging_steps=window,
                    per_device_train_batch_size=4,
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
    on, off = clocks["on"], clocks["off"]
    step_off_ms = 1e3 * off.window_s() / window
    own_ms = 1e3 * own.spent[0] / max(own.steps, 1)
    return {
        "trl_callback_overhead_ratio": on.window_s() / off.window_s(),
        "logging_steps": window,
        # a step that exports, with the callback over without: every step at logging_steps=1
        "log_step_ratio": statistics.median(on.logging) / statistics.median(off.logging),
        # the callback's own CPU time per step (events and hooks, the window's export shared
        # by its steps), and 1 + it / the off step
        "callback_cpu_ms_per_step": own_ms,
        "callback_cpu_ratio": 1.0 + own_ms / step_off_ms,
        "step_ms_on_median": 1e3 * on.window_s() / window,
        "step_ms_off_median": step_off_ms,
        "log_step_ms_on_median": 1e3 * statistics.median(on.logging),
        "log_step_ms_off_median": 1e3 * statistics.median(off.logging),
        "steps": len(on.quiet) + len(on.logging),
        "blocks": blocks,
        "model": dict(_MODEL if model is None else model),
    }


if __name__ == "__main__":
    print(trl_bench(blocks=2, windows_per_block=1))

"""``trl_callback_overhead_ratio``: SFT steps with MoEMetricsCallback over the same steps without.

TRL's ``SFTTrainer`` on a random Qwen3-MoE built from a config (4 layers, 8 experts, top-2,
hidden 128; one thread; a step of at least 100 ms on a CPU), gradient accumulation 2, padded
batches, every flag on (``moe_per_layer_logging``, throughput, FLOPs, router health) and TRL's
own default ``logging_steps`` (``SFTConfig``'s: 10), so one step in ``logging_steps`` exports.
Two trainers, one with the callback and one without, train in blocks of whole logging
windows; a step's time is the interval between two ``on_step_begin`` calls (forward,
backward, optimizer, and on a logging step the export and the Trainer's logging; the console
printer is removed from both, it would time printing).

Each ``train()`` call re-seeds, so both trainers step through the same batches; they train in
two threads taking turns a step at a time (one runs at a time), so each step with the callback
is paired with the same step without it, run next to it (the batches' padded lengths vary a
step's time by +-10 %, and the machine's speed drifts over seconds, both more than the cost
measured). The callback moves from one trainer to the other every other block (a fresh
callback, attached at ``on_train_begin``), and which trainer steps first alternates every
block: two copies of one model in two places of memory run at speeds that differ by up to
1 % by themselves, and a block's steps share an offset of a few percent (the memory its
``train()`` call got), so many short blocks beat a few long ones. Without flags (an A/A run)
the ratio is 1.000 over 16 blocks. ``quiet_step_ratio`` and ``log_step_ratio`` are the
medians over paired steps that do not log and that log; the ratio weighs them as a window
does::

    ((W - 1) * quiet_step_ratio * quiet_off + log_step_ratio * log_off)
    / ((W - 1) * quiet_off + log_off)

with ``W = logging_steps`` and the median step times without the callback. ``log_step_ratio``
is also the cost of every step at ``logging_steps=1``: a window's export costs about the same
whatever its steps. The setup's objects are frozen out of Python's garbage collector first
(``gc.freeze``): a full collection over them took about 200 ms, charged to whichever step ran.
"""

from __future__ import annotations

import gc
import importlib.util
import random
import statistics
import tempfile
import threading
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


class Turnstile:
    """Two trainers in two threads taking turns a step at a time (only one runs at once)."""

    def __init__(self, names: tuple[str, str]) -> None:
        self._names = names
        self._cond = threading.Condition()
        self._turn = ""
        self._done: set[str] = set()
        self._errors: list[str] = []

    def start(self, first: str) -> None:
        self._turn, self._done = first, set()

    def _other(self, name: str) -> str:
        return self._names[1] if name == self._names[0] else self._names[0]

    def wait(self, name: str) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._turn == name or self._other(name) in self._done, timeout=600
            ):
                self._errors.append(f"{name}: no turn in 600 s")

    def hand_over(self, name: str) -> None:
        with self._cond:
            self._turn = self._other(name)
            self._cond.notify_all()
        self.wait(name)

    def finish(self, name: str) -> None:
        with self._cond:
            self._done.add(name)
            self._turn = self._other(name)
            self._cond.notify_all()

    def check(self) -> None:
        if self._errors or self._done != set(self._names):
            raise RuntimeError(f"trl_bench: a trainer did not finish its block ({self._errors})")


#: the two trainers; the callback is on one of them in each block
_TRAINERS = ("a", "b")


def _other(name: str) -> str:
    return _TRAINERS[1] if name == _TRAINERS[0] else _TRAINERS[0]


def default_logging_steps() -> int:
    """TRL's own default ``logging_steps`` for SFT (``SFTConfig``'s; the Trainer's is 500)."""
    from trl import SFTConfig

    return int(SFTConfig.__dataclass_fields__["logging_steps"].default)


def trl_bench(
    blocks: int = 4,
    windows_per_block: int = 1,
    model: dict[str, Any] | None = None,
    flags: dict[str, bool] | None = None,
    logging_steps: int | None = None,
) -> dict[str, Any]:
    """Time ``blocks`` blocks of both trainers, ``windows_per_block`` logging windows each;
    returns the ratio and its details.

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

    turns = Turnstile(_TRAINERS)

    class StepClock(TrainerCallback):
        """Each ``train()`` call's step times by global step (from a step's ``on_step_begin``
        to the next one's, less the other trainer's turn in between)."""

        def __init__(self, name: str) -> None:
            self.name = name
            self.begin: float | None = None
            self.runs: list[dict[int, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            turns.wait(self.name)
            self.begin = None
            self.runs.append({})

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.begin is not None:  # the step that ended is global_step
                self.runs[-1][state.global_step] = now - self.begin
                turns.hand_over(self.name)
            self.begin = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            turns.finish(self.name)

        def steps(self, block: int, logging: bool) -> list[tuple[int, float]]:
            """``(step, seconds)`` of a block's steps that log (or do not)."""
            return [
                (step, seconds)
                for step, seconds in sorted(self.runs[block].items())
                if (step % window == 0) == logging
            ]

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
    clocks = {name: StepClock(name) for name in _TRAINERS}
    trainers: dict[str, Any] = {}
    attached: dict[str, Any] = {}  # trainer -> its MoEMetricsCallback while it is "on"

    def switch_on(name: str | None) -> None:
        """The callback (and OwnTime after it) on trainer ``name`` only, freshly attached
        (None: on neither)."""
        for other, callback in list(attached.items()):
            if other != name:
                trainers[other].remove_callback(callback)
                trainers[other].remove_callback(own)
                callback.detach()
                del attached[other]
        if name is not None and name not in attached:
            callback = MoEMetricsCallback(config)
            for event in ("on_step_begin", "on_step_end", "on_substep_end", "on_log"):
                setattr(callback, event, timed_call(getattr(callback, event), own.spent,
                                                    time.process_time))  # fmt: skip
            trainers[name].add_callback(callback)
            trainers[name].add_callback(own)  # after the callback: it wraps the hooks attached
            attached[name] = callback

    roles: list[str] = []  # the trainer that is "on" in each block
    try:
        with tempfile.TemporaryDirectory(prefix="nmm_trl_bench_") as work:
            fields = _MODEL if model is None else model
            model_dir = example.save_tiny_model(Path(work) / "model", **fields)
            for name in _TRAINERS:
                trainer = example.build_trainer(
                    "sft", model_dir, Path(work) / name, [clocks[name]],
                    max_steps=windows_per_block * window + 1, logging_steps=window,
                    per_device_train_batch_size=4,
                )  # fmt: skip
                # The console printer would time printing the extra keys, not the metrics.
                trainer.remove_callback(PrinterCallback)
                data = Dataset.from_list([{"text": t} for t in texts])
                trainer.train_dataset = trainer._prepare_dataset(
                    data, trainer.processing_class, trainer.args, False, None, "train"
                )
                trainers[name] = trainer
            # The setup's objects (transformers, TRL, datasets) frozen out of the collector:
            # a full collection over them took about 200 ms, charged to whichever step ran.
            gc.collect()
            gc.freeze()
            for block in range(blocks):
                # The callback moves between the two trainers every other block, and which
                # trainer steps first alternates every block: two copies of one model in two
                # places in memory differ in speed by themselves (about 0.5 %, run without
                # flags), and so may whoever runs first after the other's turn.
                on = _TRAINERS[(block // 2) % 2]
                switch_on(on)
                roles.append(on)
                turns.start(on if block % 2 == 0 else _other(on))
                runs = [threading.Thread(target=t.train) for t in trainers.values()]
                for run in runs:
                    run.start()
                for run in runs:
                    run.join()
                turns.check()
            switch_on(None)
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
    ratios, off_ms, block_ratios = {}, {}, []
    for logging in (False, True):
        pairs: list[tuple[float, float]] = []
        for block, on in enumerate(roles):
            mine = clocks[on].steps(block, logging)
            theirs = clocks[_other(on)].steps(block, logging)
            if [step for step, _ in mine] != [step for step, _ in theirs]:
                raise RuntimeError("trl_bench: the two trainers did not run the same steps")
            block_pairs = [(a, b) for (_, a), (_, b) in zip(mine, theirs, strict=True)]
            if not logging:
                block_ratios.append(statistics.median(a / b for a, b in block_pairs))
            pairs += block_pairs
        ratios[logging] = statistics.median(a / b for a, b in pairs)
        off_ms[logging] = 1e3 * statistics.median(b for _, b in pairs)
    quiet, log = (window - 1) * off_ms[False], off_ms[True]
    ratio = (quiet * ratios[False] + log * ratios[True]) / (quiet + log)
    step_off_ms = (quiet + log) / window
    own_ms = 1e3 * own.spent[0] / max(own.steps, 1)
    return {
        "trl_callback_overhead_ratio": ratio,
        "logging_steps": window,
        "quiet_step_ratio": ratios[False],
        # a step that exports, with the callback over without: every step at logging_steps=1
        "log_step_ratio": ratios[True],
        # the callback's own CPU time per step (events and hooks, the window's export shared
        # by its steps), and 1 + it / the off step
        "callback_cpu_ms_per_step": own_ms,
        "callback_cpu_ratio": 1.0 + own_ms / step_off_ms,
        "step_ms_off_median": step_off_ms,
        "step_ms_on_median": step_off_ms * ratio,
        "log_step_ms_off_median": off_ms[True],
        "log_step_ms_on_median": off_ms[True] * ratios[True],
        "steps": sum(len(clocks[on].runs[block]) for block, on in enumerate(roles)),
        # each block's median quiet-step ratio, with the trainer the callback was on
        "block_quiet_ratios": [
            (on, round(r, 4)) for on, r in zip(roles, block_ratios, strict=True)
        ],
        "blocks": blocks,
        "model": dict(_MODEL if model is None else model),
    }


if __name__ == "__main__":
    print(trl_bench(blocks=2, windows_per_block=1))

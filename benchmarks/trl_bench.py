"""``trl_callback_overhead_ratio``: SFT steps with MoEMetricsCallback over the same steps without.

TRL's ``SFTTrainer`` on a random Qwen3-MoE built from a config (4 layers, 8 experts, top-2,
hidden 128; one thread; a step of at least 100 ms on a CPU), gradient accumulation 2, padded
batches, every flag on (``moe_per_layer_logging``, throughput, FLOPs, router health) and TRL's
own default ``logging_steps`` (``SFTConfig``'s: 10), so one step in ``logging_steps`` exports.
Two trainers, one with the callback and one without, train in blocks of whole logging
windows; a step's time is the interval between two ``on_step_begin`` calls (forward,
backward, optimizer, and on a logging step the export and the Trainer's logging; the console
printer is removed from both, it would time printing).

Each trainer runs in a process of its own, in its main thread as a training script does (two
threads of one process allocate from glibc arenas of their own, which page-faulted twice as
often on the callback's thread). Each ``train()`` call re-seeds, so both trainers step through
the same batches, and they take turns a step at a time (two semaphores; one runs at a time),
so each step with the callback is paired with the same step without it, run next to it (the
batches' padded lengths vary a step's time by +-10 %, and the machine's speed drifts over
seconds, both more than the cost measured). The callback moves from one trainer to the other
every other block (a fresh callback, attached at ``on_train_begin``), and which trainer steps
first alternates every block: two copies of one model run at speeds that differ by
themselves, and a block's steps share an offset of a few percent (the memory its ``train()``
call got), so many short blocks beat a few long ones. Without flags (an A/A run) the ratio
was 0.995-1.000 over 16 blocks. ``quiet_step_ratio`` and ``log_step_ratio`` are the medians
over paired steps that do not log and that log; the ratio weighs them as a window does::

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
import multiprocessing
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.harness import timed_call, wrap_package_hooks

_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "integrate_trl.py"
#: the benchmark model: a step of >= 100 ms on one CPU thread
_MODEL = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
)  # fmt: skip
#: the two trainers (one process each); the callback is on one of them in each block
_TRAINERS = ("a", "b")
#: seconds a trainer waits for its turn, or for the parent's next order, before giving up
_WAIT_S = 600.0


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


def _other(name: str) -> str:
    return _TRAINERS[1] if name == _TRAINERS[0] else _TRAINERS[0]


def default_logging_steps() -> int:
    """TRL's own default ``logging_steps`` for SFT (``SFTConfig``'s; the Trainer's is 500)."""
    from trl import SFTConfig

    return int(SFTConfig.__dataclass_fields__["logging_steps"].default)


def _trainer_process(name: str, conn: Any, turns: dict[str, Any], setup: dict[str, Any]) -> None:
    """One trainer in its own process, its steps in turn with the other's: builds the trainer,
    then trains one block per order from the parent (with the callback or without) and sends
    back the block's step times and the callback's own CPU time."""
    try:
        _serve_blocks(name, conn, turns, setup)
    except BaseException:
        conn.send(("error", f"trainer {name}: {traceback.format_exc()}"))


def _serve_blocks(name: str, conn: Any, turns: dict[str, Any], setup: dict[str, Any]) -> None:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback

    torch.set_num_threads(1)
    example = _example()
    mine, theirs = turns[name], turns[_other(name)]

    def take_turn() -> None:
        if not mine.acquire(timeout=_WAIT_S):
            raise RuntimeError(f"no turn in {_WAIT_S:.0f} s (the other trainer stopped?)")

    class StepClock(TrainerCallback):
        """A ``train()`` call's step times by global step: from a step's ``on_step_begin`` to
        the next one's, less the other trainer's turn in between."""

        def __init__(self) -> None:
            self.begin: float | None = None
            self.steps: dict[int, float] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            take_turn()
            self.begin, self.steps = None, {}

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.begin is not None:  # the step that ended is global_step
                self.steps[state.global_step] = now - self.begin
                theirs.release()
                take_turn()
            self.begin = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            theirs.release()

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

    rng = random.Random(0)
    texts = [
        " ".join(rng.choice(example.WORDS) for _ in range(rng.randint(60, 120))) for _ in range(64)
    ]
    clock = StepClock()
    window = setup["window"]
    with tempfile.TemporaryDirectory(prefix=f"nmm_trl_bench_{name}_") as work:
        trainer = example.build_trainer(
            "sft", setup["model_dir"], Path(work), [clock],
            max_steps=setup["windows_per_block"] * window + 1, logging_steps=window,
            per_device_train_batch_size=4,
        )  # fmt: skip
        # The console printer would time printing the extra keys, not the metrics.
        trainer.remove_callback(PrinterCallback)
        data = Dataset.from_list([{"text": t} for t in texts])
        trainer.train_dataset = trainer._prepare_dataset(
            data, trainer.processing_class, trainer.args, False, None, "train"
        )
        config = MetricsConfig(**setup["flags"])
        # The setup's objects (transformers, TRL, datasets) frozen out of the collector: a
        # full collection over them took about 200 ms, charged to whichever step ran.
        gc.collect()
        gc.freeze()
        conn.send(("ready",))
        attached: tuple[Any, Any] | None = None  # the callback and its OwnTime while "on"
        while conn.poll(_WAIT_S):
            order, on = conn.recv()
            if order == "stop":
                break
            if attached is not None and not on:
                for callback in attached:
                    trainer.remove_callback(callback)
                attached[0].detach()
                attached = None
            if attached is None and on:
                callback, own = MoEMetricsCallback(config), OwnTime()
                for event in ("on_step_begin", "on_step_end", "on_substep_end", "on_log"):
                    setattr(callback, event, timed_call(getattr(callback, event), own.spent,
                                                        time.process_time))  # fmt: skip
                trainer.add_callback(callback)
                trainer.add_callback(own)  # after the callback: it wraps the hooks attached
                attached = (callback, own)
            spent, steps = (attached[1].spent[0], attached[1].steps) if attached else (0.0, 0)
            trainer.train()
            if attached:
                spent, steps = attached[1].spent[0] - spent, attached[1].steps - steps
            conn.send(("steps", dict(clock.steps), spent, steps))


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
    window = default_logging_steps() if logging_steps is None else logging_steps
    if window < 2:
        raise ValueError(f"logging_steps={window}: a window needs a step that does not log")
    context = multiprocessing.get_context("spawn")
    turns = {name: context.Semaphore(0) for name in _TRAINERS}
    roles: list[str] = []  # the trainer that is "on" in each block
    runs: dict[str, list[dict[int, float]]] = {name: [] for name in _TRAINERS}
    own_spent, own_steps = 0.0, 0
    with tempfile.TemporaryDirectory(prefix="nmm_trl_bench_") as work:
        fields = _MODEL if model is None else model
        setup = {
            "model_dir": _example().save_tiny_model(Path(work) / "model", **fields),
            "window": window,
            "windows_per_block": windows_per_block,
            "flags": ALL_FLAGS if flags is None else flags,
        }
        pipes, processes = {}, []
        try:
            for name in _TRAINERS:
                pipes[name], child = context.Pipe()
                process = context.Process(
                    target=_trainer_process, args=(name, child, turns, setup), daemon=True
                )
                process.start()
                processes.append(process)
            for name in _TRAINERS:
                _receive(pipes[name], name)
            for block in range(blocks):
                # The callback moves between the two trainers every other block, and which
                # trainer steps first alternates every block: two copies of one model run at
                # speeds that differ by themselves, and so may whoever steps first.
                on = _TRAINERS[(block // 2) % 2]
                roles.append(on)
                for name in _TRAINERS:
                    pipes[name].send(("train", name == on))
                turns[on if block % 2 == 0 else _other(on)].release()
                for name in _TRAINERS:
                    _, steps, spent, counted = _receive(pipes[name], name)
                    runs[name].append(steps)
                    own_spent, own_steps = own_spent + spent, own_steps + counted
                for turn in turns.values():  # the last trainer's hand-over went unused
                    while turn.acquire(block=False):
                        pass
            for name in _TRAINERS:
                pipes[name].send(("stop", False))
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
    ratios, off_ms, block_ratios = {}, {}, []
    for logging in (False, True):
        pairs: list[tuple[float, float]] = []
        for block, on in enumerate(roles):
            mine, theirs = (
                sorted((s, t) for s, t in runs[name][block].items() if (s % window == 0) == logging)
                for name in (on, _other(on))
            )
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
    own_ms = 1e3 * own_spent / max(own_steps, 1)
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
        "steps": sum(len(runs[on][block]) for block, on in enumerate(roles)),
        # each block's median quiet-step ratio, with the trainer the callback was on
        "block_quiet_ratios": [
            (on, round(r, 4)) for on, r in zip(roles, block_ratios, strict=True)
        ],
        "blocks": blocks,
        "model": dict(_MODEL if model is None else model),
    }


def _receive(pipe: Any, name: str) -> tuple:
    """The next message of trainer ``name``; raises its error, or after :data:`_WAIT_S`."""
    if not pipe.poll(_WAIT_S):
        raise RuntimeError(f"trl_bench: trainer {name} sent nothing in {_WAIT_S:.0f} s")
    message = pipe.recv()
    if message[0] == "error":
        raise RuntimeError(f"trl_bench: {message[1]}")
    return message


if __name__ == "__main__":
    print(trl_bench(blocks=2, windows_per_block=1))

"""transformers ``Trainer`` and TRL (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``): one callback.

One line in a training script::

    trainer = SFTTrainer(..., callbacks=[MoEMetricsCallback(MetricsConfig(track_moe_metrics=True))])

It is a thin layer over :class:`~nemo_moe_metrics.worker.PolicyMetrics` (docs/en/trl.md tells
the five traps a hand-written callback falls into and how this one answers each):

- **every backend and ``log_history``**: callbacks given in ``callbacks=[...]`` run after the
  Trainer's reporting callbacks (TensorBoard, W&B, MLflow, trackio, comet), and
  ``trainer.state.log_history`` is copied before any of them runs. The callback therefore moves
  itself to the front of the Trainer's callback list (at ``on_init_end``, and again at
  ``on_train_begin`` for one added later with ``add_callback``), and adds its keys to the dict
  every reporting callback then receives and to the ``log_history`` entry of the same call;
- **one optimizer step, one measured step**: ``on_step_begin`` .. ``on_step_end`` is one
  ``PolicyMetrics.step()``; every training forward of the model inside it (model in
  ``train()`` mode, autograd on: each gradient-accumulation microbatch, each of GRPO's chunked
  loss forwards) is one ``microbatch()``, with its real lengths from the forward's own
  ``attention_mask`` (or packed ``position_ids``). Evaluation, generation, reference and
  old-logprob scoring run without grad or in ``eval()`` and are not training forwards.
  Gradient checkpointing replays layers in backward, never the model's forward: counted once;
- **a logging window** (``logging_steps=N``) is one export: expert counts and tokens summed
  over its N steps, every ratio (``max_over_ideal``, tokens/s, MFU) a ratio of those sums,
  seconds summed, aux losses the mean over its microbatches;
- **generation** (``model.generate`` inside a training step, GRPO's rollout) is taken out of
  the step: ``train_perf/`` times and counts the training part only, and ``gen_perf/`` (tokens,
  seconds, tokens/s) describes the generation;
- **a step that raises** leaves no partial counts: the next ``on_step_begin`` (or the next
  ``train()``) discards the open step and starts afresh.

With ``run_dir``, rank 0 also writes the run directory ``nemo-moe-metrics report`` reads
(``metrics.jsonl``, ``expert_loads.bin``, ``run.json``; more sinks through ``logger``), at the
Trainer's ``global_step``, through :func:`~nemo_moe_metrics.run_dir.session.open_run` like every
writer: it holds the directory's owner lock from ``on_train_begin`` to ``on_train_end`` (a second
writer, another callback or another process, is refused naming the holder); a ``train()`` that
resumes from a checkpoint continues the run at the checkpoint's step (later records cut, totals
from that step), and a fresh ``train()`` into a directory holding a run is refused unless
``overwrite=True``. A ``train()`` that raised never reaches ``on_train_end``: the next
``train()`` in the same thread closes what it left open (its lock included) before opening again.

**Running first, without walking stack frames.** transformers gives a callback no route to
the Trainer or its ``CallbackHandler``: events receive ``args``, ``state``, ``control`` and the
model, tokenizer, optimizer, scheduler and dataloaders only, and ``add_callback`` appends. The
callback therefore asks the garbage collector which lists hold it (``gc.get_referrers``, one
scan of the tracked objects, tens of milliseconds, twice per ``train()``) and moves itself to
the front of the one that also holds the Trainer's ``DefaultFlowCallback``: the handler's
``callbacks`` list, public and never replaced. Unlike the frame walk it replaces, this depends
neither on how deep the handler sits in the call stack nor on reading other frames' locals.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nemo_moe_metrics.config import LoggerConfig, MetricsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.run_dir.session import RunSession, open_run
from nemo_moe_metrics.runtime.extras import require
from nemo_moe_metrics.sinks.base import split_tables, validate_metrics
from nemo_moe_metrics.throughput import StepMeter
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

log = logging.getLogger(__name__)

_transformers = require("transformers", "hf", "nemo_moe_metrics.integrations.transformers")
TrainerCallback = _transformers.TrainerCallback
DefaultFlowCallback = _transformers.trainer_callback.DefaultFlowCallback

#: What the Trainer logs when it evaluates or predicts (metric_key_prefix): no window is closed.
_EVAL_PREFIXES = ("eval_", "test_", "predict_")
#: gen_perf/ from a StepMeter's interval keys.
_GENERATION_KEYS = {
    mn.TOKENS: mn.GENERATION_TOKENS,
    mn.SECONDS: mn.GENERATION_SECONDS,
    mn.TOKENS_PER_SECOND: mn.GENERATION_TOKENS_PER_SECOND,
}


class _StepAbandoned(Exception):
    """Raised into an open ``PolicyMetrics.step()`` whose optimizer step never ended."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model under DDP / accelerate / ``torch.compile`` wrappers (FSDP2 shards in place)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def forward_lengths(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Real tokens per sequence of one model forward, on its device, no host read.

    From ``attention_mask`` ``[batch, seq]`` (1 = real token); else from packed
    ``position_ids`` ``[1, total]`` (a sequence starts where the position is 0: one length per
    position, the lengths first and zeros after, so the shape needs no value); else every
    position of ``input_ids`` / ``inputs_embeds``. None when the forward has no token input.
    """
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.to(torch.int64).sum(-1)
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return None
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == 1:
        starts = (positions[0] == 0).to(torch.int64)
        sequence = (starts.cumsum(0) - 1).clamp(min=0)
        return torch.zeros_like(starts).scatter_add_(0, sequence, torch.ones_like(starts))
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    return torch.full((rows,), width, dtype=torch.int64, device=ids.device)


def generated_lengths(
    prompt_mask: torch.Tensor | None,
    prompt_width: int,
    sequences: torch.Tensor,
    eos_ids: list[int],
) -> torch.Tensor:
    """Real tokens per sequence of one ``generate`` call: the prompt's (its mask) plus the
    completion's up to and including its first end-of-sequence token. Device ops only."""
    completion = sequences[:, prompt_width:]
    if eos_ids:
        eos = torch.isin(completion, torch.tensor(eos_ids, device=completion.device))
        before_end = (eos.to(torch.int64).cumsum(-1) - eos.to(torch.int64)) == 0
        completion_tokens = before_end.to(torch.int64).sum(-1)
    else:
        completion_tokens = torch.full_like(completion[:, 0], completion.shape[1])
    if prompt_mask is None:
        prompt_tokens = torch.full_like(completion_tokens, prompt_width)
    else:
        prompt_tokens = prompt_mask.to(torch.int64).sum(-1)
    return (prompt_tokens + completion_tokens).to(torch.int64)


def _eos_ids(model: nn.Module, kwargs: dict) -> list[int]:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]


def _training_forward(model: nn.Module) -> bool:
    # Not inside autograd's backward: a checkpoint that replayed the whole model would be there.
    return (
        model.training
        and torch.is_grad_enabled()
        and (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1)
    )


class MoEMetricsCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that logs ``moe/``, ``train_perf/`` and ``gen_perf/``.

    Args:
        metrics_cfg: the metric flags (a :class:`MetricsConfig` or a dict of them).
        vocab_size: the output-layer size for the FLOP estimate; None reads it from the
            model's config.
        run_dir: where rank 0 writes the run directory ``nemo-moe-metrics report`` reads
            (``metrics.jsonl``, ``expert_loads.bin``, ``run.json``); None: nothing written,
            the keys reach the Trainer's own ``report_to`` backends only. A directory holding
            a run is continued when the Trainer resumes from a checkpoint, from its step.
        logger: the sinks of ``run_dir``: JSONL and the expert-load store, whether ``logger``
            is left out or given (``LoggerConfig(table_every=1)``); TensorBoard and W&B only
            when set explicitly (``tensorboard_enabled=True``), as the Trainer's ``report_to``
            already writes TensorBoard, W&B, MLflow, trackio. ``logger.resume`` is not taken:
            the run directory is continued exactly when the Trainer resumes.
        overwrite: a fresh ``train()`` into a ``run_dir`` holding a run deletes that run's
            own files first (otherwise it is refused, saying so).

    ``callback.metrics`` is the :class:`PolicyMetrics` (after ``on_train_begin``);
    ``callback.last_metrics`` the last window's dict (the same on every rank, tables included).
    """

    def __init__(
        self,
        metrics_cfg: MetricsConfig | Mapping[str, Any],
        vocab_size: int | None = None,
        *,
        run_dir: str | Path | None = None,
        logger: LoggerConfig | Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        self.cfg = (
            metrics_cfg
            if isinstance(metrics_cfg, MetricsConfig)
            else MetricsConfig.model_validate(dict(metrics_cfg))
        )
        self.logger = callback_logger(logger)
        self.overwrite = overwrite
        self.vocab_size = vocab_size
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._session: RunSession | None = None
        # The train() that opened the session: its thread and TrainerState (see _stale_writers)
        self._opened_in: tuple[int, Any] | None = None
        self.metrics: PolicyMetrics | None = None
        self.last_metrics: dict[str, Any] = {}
        self._model: nn.Module | None = None
        self._hooks: list[Any] = []
        self._original_generate: Any = None
        self._step: Any = None  # the open PolicyMetrics.step() context manager
        self._window_steps = 0
        self._window_microbatches = 0
        self._microbatches_at_open = 0
        self._generation: StepMeter | None = None
        self._warned_order = False

    # -- Trainer events --------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Run first among the Trainer's callbacks (see the module docstring)."""
        self._move_first()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Attach to the unwrapped model once; open the run directory on rank 0."""
        self._move_first()
        self._abandon_step()
        model = kwargs.get("model")
        if self.metrics is None:
            if model is None:
                raise RuntimeError(
                    "MoEMetricsCallback: the Trainer passed no model to on_train_begin"
                )
            self._attach(unwrap_model(model))
        resume_after = int(state.global_step) or None  # a checkpoint's step, or a fresh run
        self._close_run_dir()  # what a train() that raised left open (its lock included)
        if self.run_dir is not None and state.is_world_process_zero:
            self._open_run_dir(args, state, resume_after)
        self._resume_totals(state, resume_after)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Open the optimizer step (a step left open by an exception is discarded first)."""
        if self.metrics is None:
            return
        self._abandon_step()
        self._open_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the optimizer step; it joins the logging window."""
        if self._step is not None:
            self._close_step()
            self._window_steps += 1

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs
    ) -> None:
        """Export the window (collective: every rank logs) into ``logs`` and ``log_history``."""
        if self.metrics is None or not self._window_steps or logs is None:
            return
        if any(key.startswith(_EVAL_PREFIXES) for key in logs):
            return
        out = self._export()
        scalars, _ = split_tables(validate_metrics(out, int(state.global_step)))
        logs.update(scalars)
        last = state.log_history[-1] if state.log_history else None
        if isinstance(last, dict) and last.get("step") == state.global_step:
            last.update(scalars)
        if self._session is not None:
            self._session.log(out, int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Store the last step's table, flush and close the run directory, give its lock back
        (a later ``train()`` that resumes from a checkpoint continues it)."""
        self._abandon_step()
        self._close_run_dir()

    # -- attach ----------------------------------------------------------------------------
    def _attach(self, model: nn.Module) -> None:
        self._model = model
        self.metrics = PolicyMetrics(self.cfg, vocab_size=self.vocab_size)
        self.metrics.attach(model, model.config)
        if not self.metrics.active:
            return
        # Before PolicyMetrics' own input hook (it reads the lengths microbatch() was given).
        self._hooks.append(
            model.register_forward_pre_hook(self._on_forward, with_kwargs=True, prepend=True)
        )
        if callable(getattr(model, "generate", None)):
            if self.cfg.track_throughput:
                self._generation = StepMeter(device=self._device(model))
            self._original_generate = model.__dict__.get("generate")
            bound = model.generate
            model.generate = functools.partial(self._generate, bound)

    @staticmethod
    def _device(model: nn.Module) -> torch.device | None:
        param = next(model.parameters(), None)
        if param is not None and param.device.type == "cuda":
            return param.device
        return None

    def detach(self) -> None:
        """Remove every hook and the ``generate`` wrapper (the model runs exactly as before)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._model is not None and "generate" in self._model.__dict__:
            del self._model.generate
            if self._original_generate is not None:
                self._model.generate = self._original_generate
        if self.metrics is not None:
            self.metrics.detach()

    # -- hooks -----------------------------------------------------------------------------
    def _on_forward(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._step is None or not _training_forward(model):
            return
        lengths = forward_lengths(args, kwargs)
        if lengths is None:
            return
        self.metrics.microbatch(seq_lens=lengths)
        self._window_microbatches += 1

    def _generate(self, generate: Any, *args: Any, **kwargs: Any) -> Any:
        # Inside a training step (GRPO's rollout) the generation leaves the step: train_perf/
        # times the training part only, gen_perf/ the generation.
        if self._step is None:
            return generate(*args, **kwargs)
        self._close_step()  # the optimizer step goes on after the generation
        try:
            eos = _eos_ids(self._model, kwargs)
            with self.metrics.generation(eos_token_ids=eos), self._generation_timer():
                sequences = generate(*args, **kwargs)
                ids = kwargs.get("input_ids", args[0] if args else None)
                timed = self._generation is not None
                if timed and isinstance(sequences, torch.Tensor) and isinstance(ids, torch.Tensor):
                    lengths = generated_lengths(
                        kwargs.get("attention_mask"), int(ids.shape[-1]), sequences, eos
                    )
                    self._generation.add_sequences(lengths)
        finally:
            self._open_step()
        return sequences

    def _generation_timer(self) -> Any:
        return self._generation.step() if self._generation is not None else contextlib.nullcontext()

    # -- steps and windows -----------------------------------------------------------------
    def _open_step(self) -> None:
        step = self.metrics.step()
        step.__enter__()
        self._step = step
        self._microbatches_at_open = self._window_microbatches

    def _close_step(self) -> None:
        step, self._step = self._step, None
        step.__exit__(None, None, None)

    def _abandon_step(self) -> None:
        # An exception left the optimizer step open: forget what it counted (PolicyMetrics
        # discards a step its body raised in), so the next step starts clean.
        if self._step is None:
            return
        step, self._step = self._step, None
        step.__exit__(_StepAbandoned, _StepAbandoned(), None)
        self._window_microbatches = self._microbatches_at_open

    def _export(self) -> dict[str, Any]:
        microbatches = max(self._window_microbatches, 1)
        self._window_steps = 0
        self._window_microbatches = 0
        out = self.metrics.finish_step(num_microbatches=microbatches)
        generation = self._generation
        if generation is not None and generation.steps:
            # Every rank generates at the same optimizer steps (TRL gathers the rollouts).
            for key, value in generation.export().items():
                if key in _GENERATION_KEYS:
                    out[_GENERATION_KEYS[key]] = value
        self.last_metrics = out
        return out

    def _move_first(self) -> None:
        # See the module docstring: the handler's list is the one holding this callback and
        # the Trainer's DefaultFlowCallback (every Trainer has one; its handler warns without).
        lists = [
            held
            for held in gc.get_referrers(self)
            if isinstance(held, list) and any(isinstance(c, DefaultFlowCallback) for c in held)
        ]
        if not lists and not self._warned_order:
            self._warned_order = True
            log.warning(
                "MoEMetricsCallback: could not find the Trainer's callback list; callbacks "
                "before it in the list (report_to backends) will not see its keys"
            )
        for callbacks in lists:
            if callbacks[0] is not self:
                # Removing at i and inserting at 0 leaves the entries after i where they were,
                # so the handler's running loop over the list calls each callback once.
                callbacks.remove(self)
                callbacks.insert(0, self)

    # -- the run directory -----------------------------------------------------------------
    def _open_run_dir(self, args: Any, state: Any, resume_after: int | None) -> None:
        run_dir = self.run_dir
        assert run_dir is not None
        for other in _stale_writers(run_dir, state):
            warnings.warn(
                f"MoEMetricsCallback: {run_dir} was left open by a train() in this thread that "
                "raised before its end; closed it (its lock released) before opening it again",
                RuntimeWarning,
                stacklevel=3,
            )
            other._close_run_dir()
        config = {
            "transformers": {
                "metrics": self.cfg.model_dump(),
                "logging_steps": getattr(args, "logging_steps", None),
            },
            "logger": {"table_every": self.logger.table_every},  # the report's cadence
        }
        name = getattr(args, "run_name", None) or run_dir.name or "transformers"
        resume = resume_after is not None
        self._session = open_run(
            run_dir,
            self.logger.model_copy(update={"resume": resume}),
            self.metrics.facts if self.metrics is not None else None,
            run_name=str(name),
            config=config,
            overwrite=self.overwrite and not resume,
            ways=_WAYS,
            resume_after=resume_after,
        )
        self._opened_in = (threading.get_ident(), weakref.ref(state))
        _WRITERS[str(run_dir.resolve())] = weakref.ref(self)

    def _close_run_dir(self) -> None:
        session, self._session = self._session, None
        self._opened_in = None
        if session is not None:
            session.close()

    def _resume_totals(self, state: Any, resume_after: int | None) -> None:
        # Every rank: the totals the checkpoint's log_history holds at its step (the Trainer
        # restored it with the step), else the run directory's (rank 0), else 0 (a fresh run).
        if self.metrics is None:
            return
        totals = _logged_totals(state.log_history, resume_after) if resume_after else None
        kept = self._session.resume_state if self._session is not None else None
        if totals is None and kept is not None:
            totals = (kept.total_tokens, kept.total_seconds, kept.total_flops)
        self.metrics.resume_totals(*(totals or (0.0, 0.0, 0.0)), restart=True)


#: What a refusal of a fresh train() into a directory holding a run says to do.
_WAYS = (
    "a fresh trainer.train() would start a second run in it from step 1. Continue it with "
    "trainer.train(resume_from_checkpoint=...) (the callback continues the run directory from "
    "the checkpoint's step), pass MoEMetricsCallback(..., overwrite=True) to delete it and "
    "start afresh, or choose another run_dir"
)

#: The callbacks that opened a run directory in this process, by resolved path (weak).
_WRITERS: dict[str, Any] = {}


def _stale_writers(run_dir: Path, state: Any) -> list[MoEMetricsCallback]:
    """Callbacks holding ``run_dir`` open from a ``train()`` that raised: opened in this same
    thread for another TrainerState (a thread runs one ``train()`` at a time, and each
    ``train()`` makes a new state), so their training is over. A holder in another thread, or
    in this very ``train()`` (a second callback), is a live writer: open_run refuses it."""
    ref = _WRITERS.get(str(run_dir.resolve()))
    other = ref() if ref is not None else None
    if other is None or other._session is None or other._opened_in is None:
        return []
    thread, opened_for = other._opened_in
    if thread != threading.get_ident() or opened_for() is state:
        return []
    return [other]


def _logged_totals(history: list[dict], step: int) -> tuple[float, float, float] | None:
    """``(total_tokens, total_seconds, total_flops)`` of the last ``log_history`` entry at or
    before ``step`` that holds them (a checkpoint's trainer state), or None."""
    for entry in reversed(history or []):
        if not isinstance(entry, dict) or entry.get("step", step + 1) > step:
            continue
        tokens, seconds = entry.get(mn.TOTAL_TOKENS), entry.get(mn.TOTAL_SECONDS)
        if isinstance(tokens, int | float) and isinstance(seconds, int | float):
            rate = entry.get(mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND)
            flops = float(rate) * float(seconds) if isinstance(rate, int | float) else 0.0
            return float(tokens), float(seconds), flops
    return None


def callback_logger(logger: LoggerConfig | Mapping[str, Any] | None) -> LoggerConfig:
    """The callback's sinks: JSONL and the expert-load store unless a backend is turned on
    explicitly (the Trainer's ``report_to`` writes TensorBoard and W&B already); a logger
    asking to resume is refused (the callback resumes exactly when the Trainer does)."""
    if logger is None:
        given: LoggerConfig = LoggerConfig()
    elif isinstance(logger, LoggerConfig):
        given = logger
    else:
        given = LoggerConfig.model_validate(dict(logger))
    if given.resume:
        raise ValueError(
            "MoEMetricsCallback: leave LoggerConfig.resume unset; the run directory is "
            "continued when the Trainer resumes (trainer.train(resume_from_checkpoint=...))"
        )
    explicit = given.model_fields_set
    off = {key: False for key in ("tensorboard_enabled", "wandb_enabled") if key not in explicit}
    return given.model_copy(update=off)

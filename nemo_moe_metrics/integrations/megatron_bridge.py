"""Megatron-Bridge: MoE metrics from a training callback, without a fork.

Two lines in a Bridge training script::

    callback = MoEMetricsCallback(MetricsConfig(track_moe_metrics=True, track_throughput=True))
    pretrain(config, callback.wrap_forward_step(forward_step), callbacks=[callback])

What happens at Bridge's events (``megatron/bridge/training/callbacks.py``, Bridge >= 0.6):

- ``on_train_start``: :class:`~nemo_moe_metrics.worker.PolicyMetrics` attaches to the model
  chunks, with the padded vocabulary computed from Bridge's model config when ``vocab_size``
  is not given (Bridge keeps ``cfg.model.vocab_size`` unpadded);
- ``on_train_step_start``: the step opens (timer, aux-loss tracker snapshot);
- the wrapped forward step: ``microbatch()`` with each batch's real lengths (packed: from
  ``cu_seqlens_q`` / ``cu_seqlens``; padded: tokens with a loss, from ``loss_mask``; nothing on a
  pipeline stage that gets no batch). A forward-backward that megatron's rerun state machine
  runs again restarts the step's counts (:meth:`PolicyMetrics.restart_step`);
- ``on_train_step_end``: ``finish_step`` on every rank (it is collective), with megatron's
  microbatch count; the scalars go to Bridge's own writers (``state.tensorboard_logger``,
  ``state.wandb_logger``) on whichever rank holds them, at the iteration Bridge's
  ``training_log`` uses (``train_state.step + 1``); on the last rank the run directory
  (``run_dir``) gets what ``nemo-moe-metrics report`` reads: ``metrics.jsonl``, the
  ``moe/expert_loads`` table in the expert-load store, ``run.json``.

Megatron's aux-loss tracker is ``shared`` by default here: Bridge's ``training_log`` (which
runs after ``on_train_step_end``) reduces, logs and clears it, and logs what it logs without us.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_moe_metrics.config import DEFAULT_TABLE_EVERY, AlertsConfig, LoggerConfig, MetricsConfig
from nemo_moe_metrics.megatron import compat  # imports no megatron module by itself
from nemo_moe_metrics.run_dir.session import open_run
from nemo_moe_metrics.sinks.base import split_tables, validate_metrics
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

log = logging.getLogger(__name__)

BRIDGE_CALLBACKS_MODULE = "megatron.bridge.training.callbacks"


def _bridge_callback_base() -> type:
    module = sys.modules.get(BRIDGE_CALLBACKS_MODULE)  # also a copy loaded by file path
    if module is None:
        try:
            import megatron.bridge.training.callbacks as module
        except ImportError as err:
            raise ImportError(
                "nemo_moe_metrics.integrations.megatron_bridge needs Megatron-Bridge with training "
                "callbacks (megatron-bridge >= 0.6, Python 3.12): pip install megatron-bridge. "
                f"Importing {BRIDGE_CALLBACKS_MODULE} failed: {err}"
            ) from err
    return module.Callback


Callback = _bridge_callback_base()


def padded_vocab_size(model_cfg: Any) -> int:
    """The vocabulary size of the model's output layer, from a Bridge model provider.

    Bridge pads ``vocab_size`` to a multiple of ``make_vocab_size_divisible_by`` times the tensor
    parallel size when ``should_pad_vocab`` (its ``calculate_padded_vocab_size``), else uses it
    as is.
    """
    vocab = getattr(model_cfg, "vocab_size", None)
    if not vocab:
        raise ValueError(
            "Bridge's model config has no vocab_size; pass MoEMetricsCallback(..., vocab_size=N) "
            "with the size of the model's output layer"
        )
    if not getattr(model_cfg, "should_pad_vocab", True):
        return int(vocab)
    divisible_by = int(getattr(model_cfg, "make_vocab_size_divisible_by", 128) or 1)
    tp = int(getattr(model_cfg, "tensor_model_parallel_size", 1) or 1)
    try:
        from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size
    except ImportError:  # Bridge's helper needs Megatron-LM; the same arithmetic
        multiple = divisible_by * tp
        return int(math.ceil(vocab / multiple) * multiple)
    return int(calculate_padded_vocab_size(vocab, divisible_by, tp, logging_enabled=False))


def batch_lengths(batch: Any) -> torch.Tensor | None:
    """Real tokens per sequence of one Bridge batch (a dict), or None when there is no batch.

    Packed: from ``cu_seqlens_q`` (else ``cu_seqlens_unpadded``, else ``cu_seqlens``), ``-1``
    padding ignored; padded: the tokens with a loss, ``loss_mask.sum(-1)``; else every token.
    No host read: the lengths stay on the batch's device.
    """
    if batch is None:
        return None
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"the data iterator yielded a {type(batch).__name__}; wrap_forward_step reads Bridge "
            "batches (dicts with tokens, loss_mask or cu_seqlens)"
        )
    for key in ("cu_seqlens_q", "cu_seqlens_unpadded", "cu_seqlens"):
        cu = batch.get(key)
        if cu is not None:
            rows = cu.reshape(-1, cu.shape[-1]) if cu.dim() > 1 else cu.reshape(1, -1)
            # -1 pads the offsets at the end: those differences are <= 0, i.e. empty sequences.
            return (rows[:, 1:] - rows[:, :-1]).clamp(min=0).reshape(-1).to(torch.int64)
    loss_mask = batch.get("loss_mask")
    if loss_mask is not None:
        rows = loss_mask.reshape(loss_mask.shape[0], -1)
        if rows.dtype.is_floating_point:  # 0/1 floats: sum first (exact below 2**24 tokens)
            return rows.sum(-1).round().to(torch.int64)
        return rows.sum(-1, dtype=torch.int64)
    tokens = batch.get("tokens")
    if tokens is None:
        return None
    return torch.full((tokens.shape[0],), tokens.shape[-1], dtype=torch.int64)


def default_run_dir(state: Any) -> Path:
    """Where the callback writes when not told: beside Bridge's TensorBoard directory, else
    beside its checkpoint save directory, else ``./nemo_moe_metrics``."""
    cfg = getattr(state, "cfg", None)
    for section, key in (("logger", "tensorboard_dir"), ("checkpoint", "save")):
        where = getattr(getattr(cfg, section, None), key, None)
        if where:
            return Path(where).parent / "nemo_moe_metrics"
    return Path.cwd() / "nemo_moe_metrics"


class _BatchTap:
    """The data iterator as the forward step sees it; reports each batch it hands out."""

    def __init__(self, inner: Any, on_batch: Callable[[Any], None]) -> None:
        self._inner = inner
        self._on_batch = on_batch

    def __iter__(self) -> _BatchTap:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._on_batch(batch)
        return batch

    def __getattr__(self, name: str) -> Any:  # RerunDataIterator's rewind, advance, ...
        return getattr(self._inner, name)


#: What a refusal of a fresh job into a directory holding a run says to do.
_BRIDGE_WAYS = (
    "a job starting at iteration 0 would start a second run in it. Restart from the job's "
    "checkpoint to continue it (the callback continues from the restored iteration), delete "
    "that run directory, or pass another run_dir"
)


class MoEMetricsCallback(Callback):
    """A Megatron-Bridge callback that measures MoE training with :class:`PolicyMetrics`.

    Args:
        metrics_cfg: the metric flags (a :class:`MetricsConfig` or a dict of them).
            ``aux_loss_tracker`` defaults to ``shared`` here (Bridge's ``training_log`` reports
            and clears megatron's tracker); set it to ``own`` only if nothing else does.
        vocab_size: the model's output-layer size for the FLOP estimate; None computes the
            padded size from Bridge's ``cfg.model``.
        run_dir: the run directory ``nemo-moe-metrics report`` reads, written on the last rank:
            ``metrics.jsonl`` (every iteration's scalars), ``expert_loads.bin`` (the table) and
            ``run.json``. None: beside Bridge's TensorBoard directory
            (``<tensorboard_dir>/../nemo_moe_metrics``), else beside its checkpoint directory,
            else ``./nemo_moe_metrics`` (:func:`default_run_dir`). A job restarted from its
            checkpoint continues the run there from the restored iteration; a job starting at
            iteration 0 into a directory holding a run is refused. The last rank holds the
            directory's owner lock until ``on_train_end`` (a second writer is refused naming it).
        table_every: write the expert-load table on iterations that are multiples of this.
        mlflow_enabled: also log to MLflow on the last rank (extra ``mlflow``): the scalars as
            metrics at Bridge's iteration, the table as CSV artifacts on ``table_every``
            iterations (:class:`nemo_moe_metrics.sinks.mlflow.MlflowSink`).
        mlflow_tracking_uri: None: a SQLite store in the run directory (``mlflow.db``).
        mlflow_experiment: the MLflow experiment's name.
        alerts: ``logger.alerts`` thresholds (an :class:`AlertsConfig` or a dict): checked on
            the last rank, recorded in metrics.jsonl and listed by the report.

    ``callback.metrics`` is the :class:`PolicyMetrics`; ``callback.last_metrics`` the last
    step's dict (the same on every rank).
    """

    def __init__(
        self,
        metrics_cfg: MetricsConfig | Mapping[str, Any],
        vocab_size: int | None = None,
        *,
        run_dir: str | Path | None = None,
        table_every: int = DEFAULT_TABLE_EVERY,
        mlflow_enabled: bool = False,
        mlflow_tracking_uri: str | None = None,
        mlflow_experiment: str = "nemo_moe_metrics",
        alerts: AlertsConfig | Mapping[str, Any] | None = None,
    ) -> None:
        cfg = (
            metrics_cfg
            if isinstance(metrics_cfg, MetricsConfig)
            else MetricsConfig.model_validate(dict(metrics_cfg))
        )
        if "aux_loss_tracker" not in cfg.model_fields_set:
            cfg = cfg.model_copy(update={"aux_loss_tracker": "shared"})
        if table_every < 1:
            raise ValueError(f"table_every must be >= 1, got {table_every}")
        if alerts is not None and not isinstance(alerts, AlertsConfig):
            alerts = AlertsConfig.model_validate(dict(alerts))
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.table_every = table_every
        self.metrics: PolicyMetrics | None = None
        self.last_metrics: dict[str, Any] = {}
        self._step: contextlib.ExitStack | None = None
        self._pass: Any = None  # the rerun state machine's pass the open step last saw
        self._store: Any = None  # the run directory's sinks (build_sinks), on the last rank
        self.mlflow_enabled = mlflow_enabled
        self.mlflow_tracking_uri = mlflow_tracking_uri
        self.mlflow_experiment = mlflow_experiment
        self.alerts = alerts if alerts is not None else AlertsConfig()

    # -- Bridge events ---------------------------------------------------------------------
    def on_train_start(self, context: Any) -> None:
        """Attach to the model chunks (``context.model``)."""
        from megatron.core.utils import get_model_config

        state = context.state
        chunks = list(context.model)
        vocab = self.vocab_size
        if vocab is None:
            vocab = padded_vocab_size(state.cfg.model)
        self.metrics = PolicyMetrics(self.cfg, vocab_size=vocab)
        self.metrics.attach(chunks, get_model_config(chunks[0]))
        try:
            self._open_store(state)
        except BaseException:
            self.metrics.detach()  # refused (a second writer): the model runs as before
            raise

    def on_train_step_start(self, context: Any) -> None:
        """Open the step (timer start, aux-loss tracker snapshot)."""
        if self.metrics is None:
            raise RuntimeError("MoEMetricsCallback: on_train_step_start before on_train_start")
        self._close_step()
        self._step = contextlib.ExitStack()
        self._step.enter_context(self.metrics.step())
        self._pass = None

    def on_train_step_end(self, context: Any) -> None:
        """Close the step, export on every rank, write to Bridge's writers and the store."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        self._close_step()
        out = self.metrics.finish_step(num_microbatches=get_num_microbatches())
        self.last_metrics = out
        iteration = int(context.state.train_state.step) + 1  # what training_log logs at
        self._write(context.state, out, iteration)

    def on_train_end(self, context: Any) -> None:
        """Close the store and remove the hooks."""
        self._close_step()
        if self._store is not None:
            self._store.close()
            self._store = None
        if self.metrics is not None:
            self.metrics.detach()

    # -- the forward step ------------------------------------------------------------------
    def wrap_forward_step(self, forward_step: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step`` with ``microbatch()`` called for each batch it draws.

        The signature is kept (Bridge inspects it to decide what to pass). The data iterator
        argument (by name ``data_iterator``, else the first iterator argument) is wrapped so the
        batch the step draws is measured as it is handed out; a stage whose iterator is None or
        yields None records nothing.
        """
        signature = inspect.signature(forward_step)

        @functools.wraps(forward_step)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._check_rerun()
            args, kwargs = self._tap_iterator(signature, args, kwargs)
            return forward_step(*args, **kwargs)

        return wrapped

    # -- internals -------------------------------------------------------------------------
    def _close_step(self) -> None:
        if self._step is not None:
            step, self._step = self._step, None
            step.close()

    def _record(self, batch: Any) -> None:
        lengths = batch_lengths(batch)
        if lengths is not None and self.metrics is not None and self._step is not None:
            self.metrics.microbatch(seq_lens=lengths)

    def _check_rerun(self) -> None:
        # A new pass of the rerun state machine within the open step: the forward-backward
        # runs again, and only the last run is the one the optimizer applies.
        if self._step is None or self.metrics is None:
            return
        current = compat.rerun_pass()
        if self._pass is not None and current != self._pass:
            self.metrics.restart_step()
        self._pass = current

    def _tap_iterator(
        self, signature: inspect.Signature, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return args, kwargs
        name = "data_iterator" if "data_iterator" in bound.arguments else None
        if name is None:
            name = next(
                (k for k, v in bound.arguments.items() if isinstance(v, Iterator)),
                None,
            )
        if name is None or bound.arguments[name] is None:
            return args, kwargs
        value = bound.arguments[name]
        if isinstance(value, list):  # virtual pipeline: one iterator per chunk
            bound.arguments[name] = [_BatchTap(v, self._record) for v in value]
        else:
            bound.arguments[name] = _BatchTap(value, self._record)
        return bound.args, bound.kwargs

    def _open_store(self, state: Any) -> None:
        """On the last rank: the run directory ``nemo-moe-metrics report`` reads (metrics.jsonl,
        the expert-load store, run.json), through
        :func:`~nemo_moe_metrics.run_dir.session.open_run`."""
        import torch.distributed as dist

        last = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        if not last or not (self.cfg.track_moe_metrics or self.cfg.track_throughput):
            return
        run_dir = self.run_dir or default_run_dir(state)
        name = (run_dir.parent if self.run_dir is None else run_dir).name or "megatron_bridge"
        # A Bridge job restarted from its checkpoint (train_state.step restored) continues the
        # run from that iteration: later records are cut, each iteration is logged once. A
        # fresh job into a directory holding a run is refused (open_run, _BRIDGE_WAYS).
        restored = int(getattr(getattr(state, "train_state", None), "step", 0) or 0)
        resume = restored > 0
        logger_cfg = LoggerConfig(
            tensorboard_enabled=False,  # Bridge's own writers get the scalars (_write)
            wandb_enabled=False,
            table_every=self.table_every,
            mlflow_enabled=self.mlflow_enabled,
            mlflow_tracking_uri=self.mlflow_tracking_uri,
            mlflow_experiment=self.mlflow_experiment,
            resume=resume,
            alerts=self.alerts,
        )
        facts = self.metrics.facts if self.metrics is not None else None
        config = {"megatron_bridge": {"metrics": self.cfg.model_dump()}}
        self._store = open_run(
            run_dir,
            logger_cfg,
            facts,
            run_name=name,
            config=config,
            ways=_BRIDGE_WAYS,
            resume_after=restored if resume else None,
        )
        kept = self._store.resume_state
        if kept is not None and self.metrics is not None:
            self.metrics.resume_totals(kept.total_tokens, kept.total_seconds, kept.total_flops)
        log.info(
            "MoEMetricsCallback: %s %s (metrics.jsonl, expert_loads.bin); read it with: "
            "nemo-moe-metrics report %s",
            "continuing" if resume else "writing",
            run_dir,
            run_dir,
        )

    def _write(self, state: Any, out: dict[str, Any], iteration: int) -> None:
        writer = getattr(state, "tensorboard_logger", None)
        wandb_writer = getattr(state, "wandb_logger", None)
        if writer is None and wandb_writer is None and self._store is None:
            return  # a rank without Bridge's writers writes nothing
        scalars, _ = split_tables(validate_metrics(out, iteration))
        if writer is not None:
            for key, value in scalars.items():
                writer.add_scalar(key, value, iteration)
        if wandb_writer is not None and scalars:
            wandb_writer.log(scalars, iteration)
        if self._store is not None:  # the run directory: JSONL, expert-load store, MLflow
            self._store.log(out, iteration)

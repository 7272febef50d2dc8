"""Step throughput and FLOP accounting: the ``train_perf/`` metrics.

A :class:`StepMeter` brackets each optimizer step (``with meter.step():``), takes the real
(non-padding) length of every sequence the step trains on (``meter.add_sequences``), and turns
them into tokens/s, estimated FLOP/s, TFLOP/s per GPU and MFU at ``meter.export()``.

Conventions (docs/en/throughput.md has every key with its formula and caveats):

- seconds: time inside ``meter.step()``. On CUDA, measured by events recorded on the current
  stream at step start and end; on CPU, by the host wall clock. Time between steps (data loading,
  generation, logging) is not counted. A step whose body raises is dropped whole.
- interval: the steps since the previous ``export()``; cumulative: since the meter was built.
- reduction: tokens and FLOPs are SUMMED over ``data_group`` (ranks that hold different
  sequences); seconds are the MAX over ``timing_group`` of each rank's summed step seconds of the
  interval (the slowest rank sets the pace). ``total_seconds`` is the sum of the exported interval
  ``seconds``, so every rate is a ratio of sums, never a mean of per-step ratios.
- context parallel: every rank passes the FULL (unsplit) lengths of its sequences and
  ``data_group`` is the data-parallel group WITHOUT context parallel, so a sequence split over
  CP ranks counts once; give ``context_parallel_group`` and the meter checks that the CP ranks
  agree.
- a rate over zero seconds is undefined: its key is left out (a gap on the dashboard), never 0.
- the per-microbatch path makes no host-device synchronisation; ``export()`` makes one, shared
  with the other families when the worker reads them together (``enqueue`` + ``read_once``).

The lengths and their device sums live in :mod:`nemo_moe_metrics.throughput.sequence_lengths`, the
step timers (host clock, device events) in :mod:`nemo_moe_metrics.throughput.step_timers`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.host_read import Pending, collective_device, host_values, read_once
from nemo_moe_metrics.moe.deferred import HostStaging

# lengths_from_*: public here too (docs/en/throughput.md, docs/en/integration.md).
from nemo_moe_metrics.throughput.sequence_lengths import (
    MAX_SEQUENCE_LENGTH,
    length_sums,
    lengths_from_attention_mask,
    lengths_from_cu_seqlens,
)
from nemo_moe_metrics.throughput.step_timers import EventTimer, WallClockTimer

#: ``estimator(seq_lens: np.ndarray[int64], causal: bool) -> obj with .total`` (training FLOPs).
FlopsEstimator = Callable[..., Any]


def perf_metrics(
    *,
    tokens: float,
    seconds: float,
    total_tokens: float,
    total_seconds: float,
    flops: float | None = None,
    total_flops: float | None = None,
    world_size: int = 1,
    peak_flops_per_gpu: float | None = None,
) -> dict[str, float]:
    """The ``train_perf/`` dict from already-reduced interval and cumulative sums (pure arithmetic).

    Rates over zero seconds are left out; FLOP keys only when ``flops`` is given; ``mfu`` only
    when ``peak_flops_per_gpu`` is given as well.
    """
    for name, value in (
        ("tokens", tokens),
        ("seconds", seconds),
        ("total_tokens", total_tokens),
        ("total_seconds", total_seconds),
    ):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if (flops is None) != (total_flops is None):
        raise ValueError("give both flops and total_flops, or neither")
    out: dict[str, float] = {
        mn.TOKENS: float(tokens),
        mn.SECONDS: float(seconds),
        mn.TOTAL_TOKENS: float(total_tokens),
        mn.TOTAL_SECONDS: float(total_seconds),
    }
    if seconds > 0:
        out[mn.TOKENS_PER_SECOND] = tokens / seconds
    if total_seconds > 0:
        out[mn.CUMULATIVE_TOKENS_PER_SECOND] = total_tokens / total_seconds
    if flops is None or total_flops is None:
        return out
    out[mn.ESTIMATED_FLOPS] = float(flops)
    if seconds > 0:
        flops_per_second = flops / seconds
        out[mn.ESTIMATED_FLOPS_PER_SECOND] = flops_per_second
        out[mn.TFLOPS_PER_GPU] = flops_per_second / world_size / 1e12
        if peak_flops_per_gpu is not None:
            out[mn.MFU] = flops_per_second / world_size / peak_flops_per_gpu
    if total_seconds > 0:
        out[mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND] = total_flops / total_seconds
    return out


def _flops_total(estimate: Any) -> float:
    total = getattr(estimate, "total", estimate)
    if isinstance(total, torch.Tensor) or not isinstance(total, (int, float, np.number)):
        raise TypeError(
            f"flops_estimator returned {type(estimate).__name__}; expected an object with a "
            "float .total (training FLOPs) or a float"
        )
    return float(total)


class StepMeter:
    """Times optimizer steps and counts their real tokens and estimated FLOPs (``train_perf/``).

    Args (keyword only):
        flops_estimator: ``f(seq_lens: np.ndarray[int64], causal=True)`` returning an object with
            ``.total`` training FLOPs (or a float); None emits no FLOP keys.
        peak_flops_per_gpu: dense peak FLOP/s of one accelerator; None emits no ``mfu``.
        device: a CUDA device times steps with CUDA events on its current stream; anything
            else (or None) uses the host wall clock.
        data_group: ranks holding different sequences (data parallel WITHOUT context parallel);
            tokens and FLOPs are summed over it. None = the default (world) group.
        timing_group: ranks over which step seconds take the MAX. None = the world group.
        world_size: accelerators the FLOP/s is shared by, for ``tflops_per_gpu`` and ``mfu``.
            None = the world size (1 without torch.distributed).
        context_parallel_group: when set, export checks that its ranks passed the same lengths
            (every CP rank passes the full, unsplit lengths).
        host_timing_group: a CPU (gloo) group with the timing group's ranks. With device
            events the step seconds are known only after the export's wait; their MAX then goes
            over this group, host to host, so the export waits on the device once. None: over
            ``timing_group`` (under NCCL a second device round trip on multi-rank runs).
        causal: passed to the estimator (causal attention counts half the score products).
        event_factory: makes timing events (``record/wait/synchronize/elapsed_time``), e.g. a
            stand-in on CPU; giving it selects the event path.
        clock: host clock in seconds for the wall-clock path.
    """

    def __init__(
        self,
        *,
        flops_estimator: FlopsEstimator | None = None,
        peak_flops_per_gpu: float | None = None,
        device: torch.device | str | None = None,
        data_group: Any = None,
        timing_group: Any = None,
        world_size: int | None = None,
        context_parallel_group: Any = None,
        host_timing_group: Any = None,
        causal: bool = True,
        event_factory: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if peak_flops_per_gpu is not None and not (
            math.isfinite(peak_flops_per_gpu) and peak_flops_per_gpu > 0
        ):
            raise ValueError(
                f"peak_flops_per_gpu must be a positive FLOP/s value (e.g. 989e12 for an H100 "
                f"in bf16), got {peak_flops_per_gpu}; use None to leave mfu out"
            )
        if peak_flops_per_gpu is not None and flops_estimator is None:
            raise ValueError(
                "peak_flops_per_gpu is set but flops_estimator is None: mfu needs estimated "
                "FLOPs; pass a flops_estimator or drop the peak"
            )
        if world_size is not None and world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._device = torch.device(device) if device is not None else None
        self._estimator = flops_estimator
        self._peak = peak_flops_per_gpu
        self._data_group = data_group
        self._timing_group = timing_group
        self._cp_group = context_parallel_group
        self._host_timing_group = host_timing_group
        self._world_size = world_size
        self._causal = causal
        self._timer: WallClockTimer | EventTimer
        if event_factory is not None:
            self._timer = EventTimer(event_factory, lambda: None)
        elif self._device is not None and self._device.type == "cuda":
            device_ = self._device
            self._timer = EventTimer(
                functools.partial(torch.cuda.Event, enable_timing=True),
                lambda: torch.cuda.current_stream(device_),
            )
        else:
            self._timer = WallClockTimer(clock)
        self._in_step = False
        self._step_lens: list[torch.Tensor] = []
        self._lens: list[torch.Tensor] = []  # committed steps of the current interval
        self._staging = HostStaging()
        # Token positions of the model inputs that held the sequences (batch x width), for
        # the check that the lengths fit in them: known sum and microbatches without it.
        self._step_inputs = _InputPositions()
        self._inputs = _InputPositions()
        self._rejected: list[str] = []  # host-known bad input of the interval (reject())
        self._total_tokens = 0.0
        self._total_seconds = 0.0
        self._total_flops = 0.0
        self._warned_mfu = False
        self.steps = 0  #: completed steps since construction
        self.failed_steps = 0  #: steps whose body raised (not counted)

    def resume(
        self,
        total_tokens: float,
        total_seconds: float,
        total_flops: float = 0.0,
        *,
        restart: bool = False,
    ) -> None:
        """Start the running totals from a resumed run's values, so ``total_*`` and the
        cumulative rates continue instead of restarting at 0. Call before the first export;
        ``restart=True``: the training itself went back to a checkpoint after steps were
        exported (a Trainer's ``train()`` again after one that raised), so the totals are set
        to that step's whatever this meter counted since."""
        for name, value in (
            ("total_tokens", total_tokens),
            ("total_seconds", total_seconds),
            ("total_flops", total_flops),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(
                    f"StepMeter.resume: {name} must be a finite number >= 0, got {value!r}; "
                    "pass the last logged train_perf/ totals of the run being resumed"
                )
        if self.steps and not restart:
            raise RuntimeError(
                "StepMeter.resume() after steps were exported; resume before the first step"
            )
        self._total_tokens = float(total_tokens)
        self._total_seconds = float(total_seconds)
        self._total_flops = float(total_flops)

    @property
    def uses_events(self) -> bool:
        """Whether steps are timed with device events (CUDA or a stand-in) instead of the clock."""
        return self._timer.uses_events

    @contextlib.contextmanager
    def step(self) -> Iterator[StepMeter]:
        """Bracket one optimizer step; if its body raises, the step is not counted."""
        if self._in_step:
            raise RuntimeError(
                "StepMeter.step() is already open: steps do not nest; close the previous "
                "`with meter.step():` block first"
            )
        self._in_step = True
        self._step_lens = []
        self._step_inputs = _InputPositions()
        self._timer.start()
        try:
            yield self
        except BaseException:
            self._timer.cancel()
            self.failed_steps += 1
            raise
        else:
            self._timer.stop()
            self._lens.extend(self._step_lens)
            self._inputs.add(self._step_inputs)
            self.steps += 1
        finally:
            self._in_step = False
            self._step_lens = []
            self._step_inputs = _InputPositions()

    def add_sequences(self, seq_lens: torch.Tensor) -> None:
        """Count one microbatch: a 1-D integer tensor of real tokens per sequence.

        Kept on its device until export; only metadata is checked here (no synchronisation).
        """
        if not self._in_step:
            raise RuntimeError(
                "add_sequences() called outside a step; call it inside `with meter.step():`"
            )
        if not isinstance(seq_lens, torch.Tensor):
            raise TypeError(
                f"seq_lens is a {type(seq_lens).__name__}; pass a tensor of per-sequence real "
                "token counts, e.g. attention_mask.sum(-1)"
            )
        if (
            seq_lens.dtype.is_floating_point
            or seq_lens.dtype.is_complex
            or (seq_lens.dtype == torch.bool)
        ):
            raise TypeError(
                f"seq_lens has dtype {seq_lens.dtype}; pass integer token counts, e.g. "
                "attention_mask.sum(-1) or lengths_from_cu_seqlens(cu_seqlens)"
            )
        if seq_lens.dim() != 1:
            raise ValueError(
                f"seq_lens has shape {tuple(seq_lens.shape)}; pass one length per sequence "
                "(1-D), e.g. attention_mask.sum(-1), not the mask itself"
            )
        if not self._timer.uses_events and not seq_lens.is_cpu:
            raise ValueError(
                f"seq_lens is on {seq_lens.device} but this meter times steps with the host "
                "clock, which cannot see asynchronous device work; build it with "
                f"StepMeter(device=torch.device('{seq_lens.device}'))"
            )
        # A private copy (a device kernel, no sync): callers may reuse the buffer. On the host,
        # into memory reused every interval (deferred.HostStaging).
        if seq_lens.is_cpu:
            self._step_lens.append(self._staging.keep(seq_lens.to(torch.int64)))
        else:
            self._step_lens.append(seq_lens.to(torch.int64, copy=True))
        self._step_inputs.unknown += 1

    def note_positions(self, positions: int) -> None:
        """The token positions (batch x width) of the model input that held the last
        microbatch's sequences; export then checks that their lengths fit (a host int)."""
        if self._step_inputs.unknown > 0:
            self._step_inputs.unknown -= 1
            self._step_inputs.known += int(positions)

    def reject(self, message: str) -> None:
        """Record bad input found on the host; export raises it here, and on every other rank
        of the timing group as "another rank found invalid input", after the collectives."""
        self._rejected.append(message)

    def discard_step_sequences(self) -> None:
        """Forget the open step's sequences (its forward-backward runs again); timing goes on."""
        self._step_lens = []
        self._step_inputs = _InputPositions()

    def export(self) -> dict[str, float]:
        """Reduce the interval across ranks and return the ``train_perf/`` metrics.

        Collective: every rank of the groups must call it at the same point. One host-device
        synchronisation (see :meth:`enqueue` for the exceptions). Bad input found here is raised
        on every rank after the collectives, so no rank is left waiting.
        """
        return read_once([self.enqueue()])[0]

    def enqueue(self) -> Pending[dict[str, float]]:
        """The first half of :meth:`export`: device sums and collectives, no host read.

        Tokens and, for a :class:`~nemo_moe_metrics.flops.core.FlopsEstimator`, the attended
        pairs per attention window are summed on the device (the estimate is linear in them), so
        the lengths never travel to the host. Two paths read more: a custom estimator without
        ``from_sums`` needs the lengths on the host first (one read before the collectives), and
        device-event timing (CUDA) knows the step seconds only after the wait, so their MAX over
        a multi-rank timing group is a second, small collective: host to host over
        ``host_timing_group`` when given (no second device wait), else a second read.
        """
        if self._in_step:
            raise RuntimeError("export() inside `with meter.step():`; export after the step ends")
        parts, self._lens = self._lens, []
        inputs, self._inputs = self._inputs, _InputPositions()
        self._timer.order_after_steps()
        estimator = self._estimator
        on_device = estimator is None or _has_sums(estimator)
        windows = tuple(estimator.attention_windows) if on_device and estimator else ()
        errors, self._rejected = self._rejected, []
        if on_device:
            sums, check = length_sums(parts, windows, self._causal, self._device)
        else:
            sums, check = self._host_flops(parts, errors)
        self._staging.reset()  # the lengths are summed: their memory is free
        # [... sums, input positions, microbatches whose input was not seen]: summed together.
        sums = torch.cat(
            [sums, host_values([inputs.known, inputs.unknown], torch.float64, sums.device)]
        )
        seconds_box: list[float] = []
        if not self._timer.uses_events:
            seconds_box.append(math.fsum(self._timer.collect()))
        dist_on = dist.is_available() and dist.is_initialized()
        sum_device = self._collective_device(self._data_group) if dist_on else sums.device
        max_device = self._collective_device(self._timing_group) if dist_on else sums.device
        # float64 holds token counts and attended pairs exactly up to 2**53.
        summed = sums.to(sum_device)
        bad = ((check[0] + check[2]) > 0).to(torch.float64) + float(bool(errors))
        if seconds_box:  # the wall clock: host seconds, known now
            secs = host_values(seconds_box[0], torch.float64, bad.device)
        else:  # device events: known after the wait; MAXed by _max_seconds
            secs = torch.zeros((), dtype=torch.float64, device=bad.device)
        maxed = torch.stack([secs, bad]).to(max_device)
        tensors = [summed, maxed]
        if dist_on:
            spread = None
            if self._cp_group is not None:
                # This rank's own tokens (summed may alias sums and is reduced in place below);
                # max(t) and max(-t) give max and -min in one collective.
                tokens = sums[0].to(self._collective_device(self._cp_group))
                spread = torch.stack([tokens, -tokens])
            _all_reduce(summed, dist.ReduceOp.SUM, self._data_group)
            _all_reduce(maxed, dist.ReduceOp.MAX, self._timing_group)
            if spread is not None:
                _all_reduce(spread, dist.ReduceOp.MAX, self._cp_group)
                tensors.append(spread)
        tensors.append(check)

        fence = None
        if self._timer.uses_events:

            def fence() -> bool:
                seconds = self._timer.collect()  # waits on an event after the queued copies
                seconds_box.append(math.fsum(seconds))
                return bool(seconds)

        def finish(host: list[np.ndarray]) -> dict[str, float]:
            return self._finish(host, windows, on_device, errors, seconds_box)

        return Pending(tuple(tensors), finish, fence)

    def _host_flops(self, parts: list[torch.Tensor], errors: list[str]):
        """A custom estimator takes host lengths: read them first, then estimate (one read)."""
        lens = (
            torch.cat([p.to("cpu") for p in parts]).numpy()  # the lengths' own host read
            if parts
            else np.zeros(0, dtype=np.int64)
        )
        negative = int((lens < 0).sum())
        too_long = int((lens > MAX_SEQUENCE_LENGTH).sum())
        valid = lens.size > 0 and not negative and not too_long
        tokens = float(lens.sum()) if valid else 0.0
        flops = 0.0
        if valid:
            try:
                flops = _flops_total(self._estimator(lens, causal=self._causal))
            except Exception as err:  # noqa: BLE001 - re-raised after the collectives
                errors.append(f"flops_estimator failed: {type(err).__name__}: {err}")
        low, high = (int(lens.min()), int(lens.max())) if lens.size else (0, 0)
        check = torch.tensor([negative, low, too_long, high], dtype=torch.int64)
        return torch.tensor([tokens, flops], dtype=torch.float64), check

    def _finish(
        self,
        host: list[np.ndarray],
        windows: tuple,
        on_device: bool,
        errors: list[str],
        seconds_box: list[float],
    ) -> dict[str, float]:
        summed, maxed, check = host[0], host[1], host[-1]
        if check[0] > 0:
            errors.insert(
                0,
                f"sequence lengths must be >= 0; got {int(check[1])} (pass real token counts, "
                "e.g. attention_mask.sum(-1))",
            )
        if check[2] > 0:
            errors.insert(
                0,
                f"a sequence length of {int(check[3]):,} tokens is over {MAX_SEQUENCE_LENGTH:,} "
                "(2**31 - 1), which no model input holds: pass each sequence's real token "
                "count, e.g. attention_mask.sum(-1), not an uninitialised or overflowed buffer",
            )
        positions, unseen = float(summed[-2]), float(summed[-1])
        summed = summed[:-2]
        if not errors and unseen == 0 and positions > 0 and float(summed[0]) > positions:
            errors.append(
                f"seq_lens add up to {float(summed[0]):,.0f} tokens but the model inputs of "
                f"those microbatches held only {positions:,.0f} token positions (batch x "
                "sequence width, all ranks): seq_lens holds one count per sequence, its real "
                "(non-padding) tokens, e.g. attention_mask.sum(-1)"
            )
        seconds = float(maxed[0])
        if self._timer.uses_events:
            seconds = self._max_seconds(seconds_box[-1] if seconds_box else 0.0)
        any_error = maxed[1] > 0
        cp_mismatch = len(host) == 4 and float(host[2][0]) != -float(host[2][1])
        if errors:
            raise ValueError("StepMeter.export: " + "; ".join(errors))
        if any_error:
            raise RuntimeError(
                "StepMeter.export: another rank of the timing group found invalid input at "
                "export; see that rank's ValueError"
            )
        if cp_mismatch:
            raise ValueError(
                "StepMeter.export: context-parallel ranks passed different sequence lengths; "
                "every CP rank must pass the full (unsplit) lengths of the same sequences, and "
                "data_group must be the data-parallel group without context parallel"
            )
        tokens = float(summed[0])
        has_flops = self._estimator is not None
        flops = 0.0
        if has_flops and on_device:
            flops = _flops_total(self._estimator.from_sums(tokens, [float(p) for p in summed[1:]]))
        elif has_flops:
            flops = float(summed[1])
        self._total_tokens += tokens
        self._total_seconds += seconds
        self._total_flops += flops
        result = perf_metrics(
            tokens=tokens,
            seconds=seconds,
            total_tokens=self._total_tokens,
            total_seconds=self._total_seconds,
            flops=flops if has_flops else None,
            total_flops=self._total_flops if has_flops else None,
            world_size=self._resolved_world_size(),
            peak_flops_per_gpu=self._peak,
        )
        mfu = result.get(mn.MFU)
        if mfu is not None and mfu > 1.0 and not self._warned_mfu:
            self._warned_mfu = True
            warnings.warn(
                f"{mn.MFU} = {mfu:.3g} > 1: check peak_flops_per_gpu and world_size, and that "
                "context-parallel or tensor-parallel replicas are not in data_group (their "
                "sequences would be counted more than once)",
                RuntimeWarning,
                stacklevel=4,
            )
        return result

    def _max_seconds(self, seconds: float) -> float:
        """Event timing: the step seconds are known after the wait; MAX them over the group."""
        if not (dist.is_available() and dist.is_initialized()):
            return seconds
        if self._host_timing_group is not None:
            on_host = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(on_host, op=dist.ReduceOp.MAX, group=self._host_timing_group)
            return float(on_host[0])  # host memory: no device wait
        if dist.get_world_size(self._timing_group) == 1:
            return seconds
        maxed = torch.tensor(
            [seconds], dtype=torch.float64, device=self._collective_device(self._timing_group)
        )
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=self._timing_group)
        return float(maxed.item())  # the event path's second read (multi-rank only)

    def _resolved_world_size(self) -> int:
        if self._world_size is not None:
            return self._world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    def _collective_device(self, group: Any) -> torch.device:
        return collective_device(group, self._device)


class _InputPositions:
    """Token positions of the model inputs that held microbatches: a known sum, and how many
    microbatches had no input seen (then the lengths are not checked against positions)."""

    def __init__(self) -> None:
        self.known = 0
        self.unknown = 0

    def add(self, other: _InputPositions) -> None:
        self.known += other.known
        self.unknown += other.unknown


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    """``all_reduce`` over ``group``; a group of one rank (a single-GPU run) has nothing to do."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _has_sums(estimator: Any) -> bool:
    return hasattr(estimator, "from_sums") and hasattr(estimator, "attention_windows")


__all__ = [
    "MAX_SEQUENCE_LENGTH",
    "StepMeter",
    "lengths_from_attention_mask",
    "lengths_from_cu_seqlens",
    "perf_metrics",
]

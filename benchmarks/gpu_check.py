#!/usr/bin/env python
"""GPU check for the step meter: real CUDA events, no per-microbatch sync, one NCCL reduction.

    python benchmarks/gpu_check.py            # on a machine with a CUDA GPU (one is enough)

Prints one ``PASS``/``FAIL`` line per check plus ``INFO`` measurements, and exits 1 if any check
failed. Without a GPU it prints a ``SKIP`` line and exits 0. ``--dry-run-cpu`` runs the same
plumbing on CPU (gloo, host clock) and skips the CUDA-only checks, to test the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

# Check the checkout this script sits in, not whichever copy happens to be installed.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir():
    sys.path.insert(0, str(_REPO))

from nemo_moe_metrics.export import metric_names as mn  # noqa: E402
from nemo_moe_metrics.testing import free_port  # noqa: E402
from nemo_moe_metrics.throughput import StepMeter, lengths_from_attention_mask  # noqa: E402

PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM; any positive value checks the arithmetic
TOY_PARAMS = 1_000_000


def toy_flops(seq_lens, causal: bool = True) -> float:
    """An independent stand-in estimator: 6 FLOPs per parameter per token."""
    return float(6 * TOY_PARAMS * int(seq_lens.sum()))


class Checks:
    """Runs named checks, printing PASS/FAIL with the detail or the error."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        try:
            detail = fn()
        except Exception as err:  # noqa: BLE001 - report and go on to the next check
            self.failed.append(name)
            print(f"FAIL {name}: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc(limit=3)
        else:
            print(f"PASS {name}: {detail}", flush=True)

    @staticmethod
    def skip(name: str, why: str) -> None:
        print(f"SKIP {name}: {why}", flush=True)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


class Setup:
    """Inputs made before any check: padded masks on the device and their lengths on the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.dim = 8192 if cuda else 256
        self.matmuls = 8 if cuda else 2  # per microbatch
        dtype = torch.bfloat16 if cuda else torch.float32
        gen = torch.Generator().manual_seed(0)
        self.x = (torch.randn(self.dim, self.dim, generator=gen) / self.dim**0.5).to(device, dtype)
        self.w = (torch.randn(self.dim, self.dim, generator=gen) / self.dim**0.5).to(device, dtype)
        self.microbatches = 4
        seq = 512
        host_lens = torch.randint(1, seq + 1, (self.microbatches, 8), generator=gen)
        self.host_lens = host_lens  # the independent expectation
        masks = torch.arange(seq)[None, None, :] < host_lens[:, :, None]
        self.masks = [m.to(torch.int64).to(device) for m in masks]

    def microbatch(self, meter: StepMeter, i: int) -> None:
        y = self.x
        for _ in range(self.matmuls):
            y = torch.tanh(y @ self.w)
        meter.add_sequences(lengths_from_attention_mask(self.masks[i]))

    def train_step(self, meter: StepMeter) -> None:
        with meter.step():
            for i in range(self.microbatches):
                self.microbatch(meter, i)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def check_collective(device: torch.device) -> str:
    backend = dist.get_backend()
    t = torch.tensor([1.5, 2.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    values = t.tolist()
    _expect(values == [1.5, 2.0], f"all_reduce on one rank changed the values: {values}")
    return f"{backend} all_reduce SUM and MAX on {device}"


def check_event_timing(setup: Setup, meter_kwargs: dict) -> str:
    meter = StepMeter(flops_estimator=toy_flops, peak_flops_per_gpu=PEAK, **meter_kwargs)
    setup.synchronize()
    outer = time.perf_counter()
    host_start = time.perf_counter()
    setup.train_step(meter)
    host_only = time.perf_counter() - host_start  # when the host returned, not the device
    setup.synchronize()
    outer = time.perf_counter() - outer
    out = meter.export()
    seconds = out[mn.SECONDS]
    _expect(0 < seconds <= outer * 1.01 + 1e-4, f"step seconds {seconds} outside (0, {outer}]")
    _expect(seconds >= 0.5 * outer, f"step seconds {seconds} far below the synced wall {outer}")
    expected_tokens = int(setup.host_lens.sum())
    _expect(out[mn.TOKENS] == expected_tokens, f"tokens {out[mn.TOKENS]} != {expected_tokens}")
    flops = 6 * TOY_PARAMS * expected_tokens
    _expect(_close(out[mn.ESTIMATED_FLOPS], flops), f"flops {out[mn.ESTIMATED_FLOPS]} != {flops}")
    _expect(
        _close(out[mn.TFLOPS_PER_GPU], flops / seconds / 1e12), "tflops_per_gpu != flops/s/1e12"
    )
    _expect(_close(out[mn.MFU], flops / seconds / PEAK), "mfu != flops/s/peak")
    _expect(_close(out[mn.TOKENS_PER_SECOND], expected_tokens / seconds), "tokens/s")
    return (
        f"step {seconds * 1e3:.2f} ms by {'events' if meter.uses_events else 'host clock'}, "
        f"synced wall {outer * 1e3:.2f} ms, host returned after {host_only * 1e3:.2f} ms; "
        f"tokens {expected_tokens}"
    )


def check_no_sync_per_microbatch(setup: Setup) -> str:
    meter = StepMeter(device=setup.device)
    probe = torch.ones(1, device=setup.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:
            probe.sum().item()
        except RuntimeError:
            pass
        else:
            raise AssertionError("sync debug mode did not catch .item(); the check would be blind")
        for _ in range(3):
            setup.train_step(meter)  # raises RuntimeError on any synchronising call
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = meter.export()
    expected = 3 * int(setup.host_lens.sum())
    _expect(out[mn.TOKENS] == expected, f"tokens {out[mn.TOKENS]} != {expected}")
    return "3 steps x 4 microbatches under torch.cuda.set_sync_debug_mode('error')"


def check_one_sync_per_export(setup: Setup) -> str:
    class CountingEvent(torch.cuda.Event):
        synchronizations = 0

        def synchronize(self) -> None:
            type(self).synchronizations += 1
            super().synchronize()

    meter = StepMeter(device=setup.device, event_factory=lambda: CountingEvent(enable_timing=True))
    for _ in range(3):
        setup.train_step(meter)
    _expect(CountingEvent.synchronizations == 0, "an event was synchronised before export")
    out = meter.export()
    _expect(
        CountingEvent.synchronizations == 1,
        f"{CountingEvent.synchronizations} synchronisations in one export (expected 1)",
    )
    _expect(out[mn.TOKENS] == 3 * int(setup.host_lens.sum()), "tokens after the single sync")
    return f"1 event synchronisation for 3 steps, {out[mn.SECONDS] * 1e3:.2f} ms"


def check_failed_step_excluded(setup: Setup, meter_kwargs: dict) -> str:
    meter = StepMeter(**meter_kwargs)
    try:
        with meter.step():
            setup.microbatch(meter, 0)
            raise RuntimeError("simulated failure")
    except RuntimeError:
        pass
    with meter.step():
        setup.microbatch(meter, 1)
    out = meter.export()
    expected = int(setup.host_lens[1].sum())
    _expect(out[mn.TOKENS] == expected, f"tokens {out[mn.TOKENS]} != {expected} (good step only)")
    _expect((meter.steps, meter.failed_steps) == (1, 1), "step counters")
    return "the raising step's tokens and time are not counted"


def measure_overhead(setup: Setup, meter_kwargs: dict) -> None:
    meter = StepMeter(**meter_kwargs)
    lens = lengths_from_attention_mask(setup.masks[0])
    n = 1000
    setup.synchronize()
    with meter.step():
        start = time.perf_counter()
        for _ in range(n):
            meter.add_sequences(lens)
        per_call = (time.perf_counter() - start) / n
    start = time.perf_counter()
    meter.export()
    export_s = time.perf_counter() - start
    print(
        f"INFO add_sequences {per_call * 1e6:.1f} us per call (host); "
        f"export of {n} microbatches {export_s * 1e3:.2f} ms",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the checks; 0 when all pass (or no GPU is present), 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run-cpu", action="store_true", help="exercise the script on CPU")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run_cpu
    if not cuda and not args.dry_run_cpu:
        print("SKIP: no CUDA GPU visible (torch.cuda.is_available() is False); nothing checked")
        return 0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        print(f"INFO device {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    checks = Checks()
    try:
        setup = Setup(device)
        meter_kwargs = {"device": device}
        setup.train_step(StepMeter(**meter_kwargs))  # warm-up: kernels, cuBLAS handles
        setup.synchronize()
        checks.run("collective", lambda: check_collective(device))
        checks.run("event_timing_and_values", lambda: check_event_timing(setup, meter_kwargs))
        if cuda:
            checks.run("no_sync_per_microbatch", lambda: check_no_sync_per_microbatch(setup))
            checks.run("one_sync_per_export", lambda: check_one_sync_per_export(setup))
        else:
            Checks.skip("no_sync_per_microbatch", "CUDA only")
            Checks.skip("one_sync_per_export", "CUDA only")
        checks.run("failed_step_excluded", lambda: check_failed_step_excluded(setup, meter_kwargs))
        measure_overhead(setup, meter_kwargs)
    finally:
        dist.destroy_process_group()
    if checks.failed:
        print(f"FAILED: {', '.join(checks.failed)}")
        return 1
    print("ALL PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``nemo-moe-metrics placement RUN_DIR`` and ``nemo-moe-metrics ingest sglang DUMP``: the
subcommands' options and what they print and write (the arithmetic is in ``plan``/``eplb``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from nemo_moe_metrics.config.limits import check_step
from nemo_moe_metrics.placement.engines import sglang_init_expert_location, vllm_eplb_config
from nemo_moe_metrics.placement.loads import WindowLoads, window_loads
from nemo_moe_metrics.placement.plan import PlacementPlan, SweepRow, build_plan, sweep
from nemo_moe_metrics.placement.sglang_dump import ingest_sglang_dump
from nemo_moe_metrics.report.placement import SWEEP_FILE, draw_sweep
from nemo_moe_metrics.run_dir.outputs import (
    OutputError,
    check_new_file,
    check_run_dir,
    write_new_file,
)
from nemo_moe_metrics.sinks.store import StoreError

__all__ = ["add_ingest_parser", "add_placement_parser", "parse_window", "plan_text", "sweep_text"]


def parse_window(text: str) -> tuple[int | None, int | None]:
    """``A-B`` (or ``A:B``), ``A-``, ``-B``, or one step ``A``: inclusive, either end open."""
    text = text.strip()
    sep = ":" if ":" in text else "-"
    first, found, last = text.partition(sep)
    if not found:
        last = first
    try:
        lo = int(first) if first.strip() else None
        hi = int(last) if last.strip() else None
    except ValueError:
        lo = hi = -1
    bad = any(v is not None and v < 0 for v in (lo, hi)) or (lo, hi) == (None, None)
    if bad or (lo is not None and hi is not None and lo > hi):
        raise argparse.ArgumentTypeError(
            f"--steps {text!r}: give an inclusive window A-B (or A:B, A-, -B, or one step A)"
        )
    return lo, hi


def add_placement_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``placement``."""
    p = sub.add_parser(
        "placement",
        help="an expert-placement plan (DeepSeek's EPLB) from a run's stored expert loads",
    )
    p.add_argument("run_dir", type=Path, help="run directory holding expert_loads.bin")
    p.add_argument("--ep-size", type=int, required=True, help="GPUs that hold experts (G)")
    p.add_argument("--redundant-experts", type=int, default=0, help="extra replicas R (0)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the G GPUs are on (1)")
    p.add_argument("--groups", type=int, default=1, help="the model's expert groups (1)")
    p.add_argument("--steps", type=parse_window, default=(None, None), help="window A-B (all)")
    p.add_argument("--phase", choices=("train", "rollout"), default="train")
    p.add_argument("--sweep", action="store_true", help="balancedness for R = 0, G, 2G, ...")
    p.add_argument("--sweep-max", type=int, default=None, help="largest R of --sweep (E)")
    p.add_argument("--out", type=Path, default=None, metavar="PLAN.json", help="write the plan")
    p.add_argument(
        "--sglang-out",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="write SGLang's --init-expert-location file of the plan",
    )
    p.add_argument(
        "--vllm-out",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="write vLLM's --eplb-config (the number of redundant experts)",
    )
    p.add_argument(
        "--sweep-out",
        type=Path,
        default=None,
        metavar="FILE.png",
        help=f"where --sweep draws its picture (default: {SWEEP_FILE} in the run directory)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace files the --*-out options name that exist"
    )
    p.add_argument(
        "--sglang-layers",
        type=int,
        default=None,
        help="decoder layers of the model, for --sglang-out (last planned layer + 1)",
    )
    p.set_defaults(func=_cmd_placement)


def add_ingest_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ingest sglang DUMP --run RUN_DIR --step S``."""
    p = sub.add_parser("ingest", help="store a rollout engine's expert loads in a run")
    p.add_argument("engine", choices=("sglang",), help="the engine that wrote DUMP")
    p.add_argument("dump", type=Path, help="SGLang expert_distribution_recorder_*.pt (stat mode)")
    p.add_argument("--run", type=Path, required=True, help="run directory to store them in")
    p.add_argument("--step", type=int, required=True, help="the training step they belong to")
    p.set_defaults(func=_cmd_ingest)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def plan_text(plan: PlacementPlan, loads: WindowLoads, phase: str, max_layers: int = 12) -> str:
    """What a person reads before deciding: balancedness before/after, the time, the copies."""
    layers, experts = plan.weight.shape
    g, r = plan.ep_size, plan.redundant_experts
    before, after = plan.balancedness_before, plan.balancedness_after
    worst = int(np.argmin(before))
    out = [
        f"{phase} loads, steps {loads.first}–{loads.last} ({loads.steps} logged, "
        f"{loads.total:,} expert-tokens): {layers} MoE layers x {experts} experts",
        f"layout: {g} GPUs on {plan.nodes} node(s), {plan.groups} expert group(s): "
        f"{plan.policy} policy; {r} redundant experts = {experts + r} physical, "
        f"{(experts + r) // g} per GPU",
        f"balancedness (mean GPU load / max GPU load): today (contiguous) mean "
        f"{before.mean():.3f}, worst layer {int(plan.layer_ids[worst])} {before[worst]:.3f}; "
        f"plan mean {after.mean():.3f}, worst {after.min():.3f}",
        f"expert part of a step (busiest GPU per layer): {_pct(plan.expert_time_ratio)} of "
        f"today's time with the plan, {_pct(plan.ideal_time_ratio)} with perfect balance "
        "(communication not modelled)",
    ]
    copies = plan.copies()
    shown = sorted(range(layers), key=lambda i: before[i])[:max_layers]
    out.append(f"per layer (the {len(shown)} least balanced today): before -> after, copies")
    for i in sorted(shown):
        extra = ", ".join(f"e{e}x{c}" for e, c in copies[i][:8])
        more = f" (+{len(copies[i]) - 8})" if len(copies[i]) > 8 else ""
        out.append(
            f"  layer {int(plan.layer_ids[i])}: {before[i]:.3f} -> {after[i]:.3f}"
            + (f"  {extra}{more}" if extra else "")
        )
    return "\n".join(out)


def sweep_text(rows: list[SweepRow], layer_ids: np.ndarray) -> str:
    """One line per R: mean and worst balancedness, expert time against R = 0's."""
    out = ["sweep: R  balancedness mean  worst (layer)  expert time vs today"]
    for row in rows:
        w = int(np.argmin(row.balancedness))
        out.append(
            f"  {row.redundant_experts:>5}  {row.balancedness.mean():.3f}  "
            f"{row.balancedness[w]:.3f} ({int(layer_ids[w])})  {_pct(row.expert_time_ratio)}"
        )
    return "\n".join(out)


def _json_bytes(data: dict) -> bytes:
    return (json.dumps(data, separators=(",", ":")) + "\n").encode()


def _outputs(args: argparse.Namespace) -> dict[str, Path]:
    """The files this run of ``placement`` writes, by option, each checked by the output rule
    (:mod:`nemo_moe_metrics.run_dir.outputs`) before anything is computed."""
    named = {
        opt: getattr(args, opt.lstrip("-").replace("-", "_"))
        for opt in ("--out", "--sglang-out", "--vllm-out", "--sweep-out")
    }
    named = {opt: path for opt, path in named.items() if path is not None}
    if "--sweep-out" in named and not args.sweep:
        raise OutputError("--sweep-out names the picture of --sweep; pass --sweep too")
    if args.sglang_layers is not None and "--sglang-out" not in named:
        raise OutputError("--sglang-layers shapes the --sglang-out file; pass --sglang-out too")
    seen: dict[str, str] = {}
    for opt, path in named.items():
        key = os.path.abspath(path)
        if key in seen:
            raise OutputError(f"{opt} and {seen[key]} name the same file {path}; name two files")
        seen[key] = opt
        check_new_file(path, option=opt, force=args.force)
    if args.sweep and "--sweep-out" not in named:
        run_dir = check_run_dir(
            args.run_dir,
            option="the run directory (for the sweep picture)",
            fix="name the picture with --sweep-out FILE.png",
        )
        named["--sweep-out"] = run_dir / SWEEP_FILE
        if (run_dir / SWEEP_FILE).is_symlink():
            raise OutputError(
                f"{run_dir / SWEEP_FILE} is a symbolic link: nothing is written over one; "
                "remove it, or name the picture with --sweep-out FILE.png"
            )
    return named


def _cmd_placement(args: argparse.Namespace) -> int:
    try:
        outputs = _outputs(args)
        loads = window_loads(args.run_dir, args.phase, *args.steps)
        source = {
            "run": str(args.run_dir),
            "phase": args.phase,
            "steps": [loads.first, loads.last],
            "logged_steps": loads.steps,
        }
        plan = build_plan(
            loads.weight,
            loads.layer_ids,
            ep_size=args.ep_size,
            redundant_experts=args.redundant_experts,
            groups=args.groups,
            nodes=args.nodes,
            source=source,
        )
        rows = (
            sweep(
                loads.weight,
                ep_size=args.ep_size,
                groups=args.groups,
                nodes=args.nodes,
                most=args.sweep_max,
            )
            if args.sweep
            else None
        )
        sglang = (
            sglang_init_expert_location(plan, args.sglang_layers)
            if "--sglang-out" in outputs
            else None
        )
    except (ValueError, StoreError, OSError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    for text in loads.skipped:
        print(f"skipped: {text}")
    print(plan_text(plan, loads, args.phase))
    files: dict[str, bytes] = {}
    if rows is not None:
        print(sweep_text(rows, loads.layer_ids))
    if "--out" in outputs:
        data = plan.to_json()
        if rows is not None:
            data["sweep"] = [
                {
                    "redundant_experts": r.redundant_experts,
                    "balancedness": [round(float(b), 6) for b in r.balancedness],
                    "expert_time_ratio": round(r.expert_time_ratio, 6),
                }
                for r in rows
            ]
        files["--out"] = _json_bytes(data)
    if sglang is not None:
        files["--sglang-out"] = _json_bytes(sglang)
    if "--vllm-out" in outputs:
        files["--vllm-out"] = _json_bytes(vllm_eplb_config(plan.redundant_experts))
    try:
        for opt, data in files.items():
            write_new_file(outputs[opt], data, force=args.force)
            print(f"wrote {outputs[opt]} ({_WHAT[opt].format(r=plan.redundant_experts)})")
        if rows is not None:
            picture = outputs["--sweep-out"]
            title = f"{args.phase} loads, G={args.ep_size}"
            today = float(plan.balancedness_before.mean())
            print(draw_sweep(picture, rows, loads.layer_ids, title, today))
    except (OSError, ValueError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    return 0


#: What each file is, as ``placement`` says when it wrote one.
_WHAT = {
    "--out": "the plan",
    "--sglang-out": "SGLang --init-expert-location, with --ep-num-redundant-experts {r}",
    "--vllm-out": "vLLM --enable-eplb --eplb-config: vLLM places the experts itself",
}


def _one_line(err: BaseException) -> str:
    """An error as one line, naming the file (a path, never a descriptor number)."""
    if isinstance(err, OSError) and not isinstance(err, OutputError):
        where = err.filename if isinstance(err.filename, str) else ""
        text = f"{where + ': ' if where else ''}{err.strerror or err}"
    else:
        text = str(err)
    return " ".join(text.split())


def _cmd_ingest(args: argparse.Namespace) -> int:
    try:
        check_step(args.step, "--step")
        dump, dropped = ingest_sglang_dump(args.dump, args.run, args.step)
    except (ValueError, StoreError, OSError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    passes, layers, experts = dump.shape
    note = f"; layers without tokens left out: {dropped}" if dropped else ""
    print(
        f"stored {args.dump.name} as rollout step {args.step} of {args.run}: {passes} passes, "
        f"{layers - len(dropped)} MoE layers x {experts} experts, "
        f"{dump.total:,} expert-tokens{note}"
    )
    return 0

"""The ``nemo-moe-metrics`` command: its parser, ``main``, and the subcommands ``check``, ``run``,
``report`` and ``flops`` (``placement`` and ``ingest``: :mod:`.placement`).

A subcommand imports what it runs when it runs (``report``: the report and its page;
``flops``: the estimators; ``run``: the launcher), so ``--help`` and ``check`` start without
torch, matplotlib or nemo-run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from nemo_moe_metrics.cli.placement import add_ingest_parser, add_placement_parser
from nemo_moe_metrics.config import ConfigError, dump_recipe, load_recipe
from nemo_moe_metrics.config.preflight import layout_summary, preflight
from nemo_moe_metrics.run_dir.lock import RunDirError
from nemo_moe_metrics.runtime.extras import MissingExtraError, check_extra


def _cmd_check(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    preflight(recipe, args.nproc)  # what `run` checks before launching, on the same ranks
    print(dump_recipe(recipe), end="")
    print(layout_summary(recipe, args.nproc))
    return 0


def _parse_steps(text: str) -> tuple[int | None, int | None]:
    first, sep, last = text.strip().partition(":")
    try:
        if not sep:
            return int(text), int(text)
        return (int(first) if first.strip() else None, int(last) if last.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--steps {text!r}: give one step (e.g. 100) or an inclusive window FIRST:LAST, "
            "FIRST: (to the end) or :LAST (from the start)"
        ) from None


def _parse_layers(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        layers = []
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(
            f"--layers {text!r}: give MoE layer indices separated by commas, e.g. 3,17,40"
        )
    return layers


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _cmd_report(args: argparse.Namespace) -> int:
    # Imported here: matplotlib is only needed by this subcommand.
    from nemo_moe_metrics.report import ReportError, render_report, resolve_run_dir
    from nemo_moe_metrics.report.html import check_page_target, size_text, write_html_report

    try:
        if args.html:  # refused before any picture is written: the extra, then where it goes
            check_extra("html", "nemo-moe-metrics report --html")
            check_page_target(resolve_run_dir(args.run_dir), args.out)
        summary = render_report(
            args.run_dir,
            steps=args.steps,
            out_dir=args.out,
            layers=args.layers,
            dead_steps=args.dead_steps,
        )
        if args.html:
            page = write_html_report(
                resolve_run_dir(args.run_dir),
                summary,
                out_dir=args.out,
                steps=args.steps,
                layers=args.layers,
            )
            summary += (
                f"\nwrote {page} ({size_text(page)}: open it in a browser, no network needed)"
            )
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        print(summary, flush=True)
    except BrokenPipeError:  # `report ... | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _cmd_flops(args: argparse.Namespace) -> int:
    import json

    from nemo_moe_metrics.flops import (
        UnknownModelTypeError,
        fixture_names,
        get_flops_estimator,
        load_fixture,
    )

    if args.list:
        print("shipped models (use with --config NAME):")
        for name in fixture_names():
            cfg = load_fixture(name)
            print(f"  {name:<22} model_type {cfg.get('model_type', '?')}")
        return 0
    if args.config is None or args.seq_lens is None:
        raise ConfigError(
            "flops needs --config (a config.json, a model directory holding one, or a shipped "
            "model: see --list) and --seq-lens N [N ...]"
        )
    if any(n < 0 for n in args.seq_lens):
        raise ConfigError(f"--seq-lens must be token counts >= 0, got {args.seq_lens}")
    if sum(args.seq_lens) == 0:
        raise ConfigError(
            f"--seq-lens {' '.join(map(str, args.seq_lens))}: zero tokens in total, so there is "
            "nothing to count; give at least one sequence length above 0, e.g. --seq-lens 4096"
        )
    path = Path(args.config).expanduser()
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"--config {args.config}: the directory has no config.json (a Hugging Face "
                    "model directory holds one); point at the file or the model directory"
                )
            path = path / "config.json"
        if path.is_file():
            config = json.loads(path.read_text())
        elif args.config.lower() in fixture_names():
            config = load_fixture(args.config)
        elif "/" in args.config or args.config.endswith(".json") or args.config.startswith("."):
            raise ConfigError(
                f"--config {args.config}: no such file or directory; give a config.json, a model "
                "directory holding one, or a shipped model name (nemo-moe-metrics flops --list)"
            )
        else:
            raise ConfigError(
                f"--config {args.config!r} is not a file or directory here, nor a shipped model; "
                f"shipped: {', '.join(fixture_names())} (nemo-moe-metrics flops --list)"
            )
        estimate = get_flops_estimator(config, vocab_size=args.vocab_size)(
            args.seq_lens, causal=args.causal
        )
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from err
    except (UnknownModelTypeError, ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from err
    if args.json:
        print(json.dumps(estimate.to_dict(), indent=2))
        return 0
    tokens = sum(args.seq_lens)
    print(
        f"{len(args.seq_lens)} sequences, {tokens} tokens, "
        f"{'causal' if args.causal else 'full (non-causal)'} attention; training FLOPs (fwd+bwd)"
    )
    print(f"{'component':<30} {'FLOPs':>12} {'share':>7}")
    for name, value in estimate.by_component.items():
        share = value / estimate.total if estimate.total else 0.0
        print(f"{name:<30} {value:>12.4e} {share:>7.1%}")
    print(f"{'total':<30} {estimate.total:>12.4e}")
    if tokens:
        print(f"{'per token':<30} {estimate.total / tokens:>12.4e}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from nemo_moe_metrics.launch import run_with_progress

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    return run_with_progress(
        args.recipe,
        args.overrides,
        args.nproc,
        args.output_dir,
        resume=args.resume,
        overwrite=args.overwrite,
        engine=args.engine,
        ray_address=args.ray_address,
    )


def add_run_dir_flags(parser: argparse.ArgumentParser) -> None:
    """``--resume`` / ``--overwrite``: what to do with a run directory that holds a run."""
    again = parser.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue the run already in the run directory"
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run directory's old run (JSONL, TensorBoard, W&B, pictures) first",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subcommand per job."""
    parser = argparse.ArgumentParser(
        prog="nemo-moe-metrics",
        description=(
            "MoE training observability (expert load, aux losses, throughput, FLOPs) for "
            "Megatron-core and Hugging Face models: check and run recipes, report a run, "
            "estimate FLOPs."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="validate a recipe (with overrides), print it and its layout on --nproc ranks",
    )
    check.add_argument("recipe", help="YAML recipe, e.g. examples/configs/sft_moe_tiny.yaml")
    check.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    check.add_argument(
        "--nproc", type=int, default=2, help="ranks to check the parallel layout for (default 2)"
    )
    check.set_defaults(func=_cmd_check)
    report = sub.add_parser(
        "report",
        help="expert-load pictures (heatmap, over steps, drift, max/ideal) and a summary of a run",
    )
    report.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    report.add_argument(
        "--steps",
        type=_parse_steps,
        default=None,
        help="one step N, or an inclusive window FIRST:LAST, FIRST: or :LAST (default: all)",
    )
    report.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the PNGs (and report.html) into DIR (created if needed) instead of the run "
        "directory",
    )
    report.add_argument(
        "--layers",
        type=_parse_layers,
        default=None,
        help="MoE layers for expert_load_over_steps.png, e.g. 3,17 (default: the 4 worst)",
    )
    report.add_argument(
        "--dead-steps",
        type=_positive,
        default=10,
        metavar="N",
        help="list experts with 0 tokens for at least N consecutive logged steps (default 10)",
    )
    report.add_argument(
        "--html",
        action="store_true",
        help="also write report.html: one self-contained page to explore the run in a browser "
        "(step slider, layer picker, hover for an expert's numbers; needs the 'html' extra)",
    )
    report.set_defaults(func=_cmd_report)
    flops = sub.add_parser("flops", help="estimate training FLOPs of a model for a batch")
    flops.add_argument(
        "--config",
        help="config.json, a model directory holding one, or a shipped model (e.g. qwen3-30b-a3b)",
    )
    flops.add_argument("--seq-lens", type=int, nargs="+", help="token count of each sequence")
    flops.add_argument("--list", action="store_true", help="list the shipped models and exit")
    flops.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count only attended (causal/window) pairs (default) or the full T x T products",
    )
    flops.add_argument("--vocab-size", type=int, default=None, help="override the lm_head width")
    flops.add_argument("--json", action="store_true", help="print {total, by_component} as JSON")
    flops.set_defaults(func=_cmd_flops)
    run = sub.add_parser(
        "run",
        help="train a recipe on local torchrun ranks via nemo-run (or Ray actors with "
        "--engine ray), with live progress",
    )
    run.add_argument("recipe", help="YAML recipe, e.g. examples/configs/grpo_moe_tiny.yaml")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    run.add_argument("--nproc", type=int, default=2, help="ranks to launch (default 2)")
    run.add_argument(
        "--output-dir", default="runs", help="runs go to DIR/<recipe name>/ (default runs/)"
    )
    run.add_argument(
        "--engine",
        choices=("torchrun", "ray"),
        default=None,
        help="torchrun: every rank runs the loop (default: the recipe's engine key, torchrun); "
        "ray: one driver runs it over Ray actors, one per rank (docs/en/ray.md)",
    )
    run.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --engine ray: a running Ray cluster (default: RAY_ADDRESS, else an embedded "
        "local Ray started and stopped with the run)",
    )
    add_run_dir_flags(run)
    run.set_defaults(func=_cmd_run)
    add_placement_parser(sub)
    add_ingest_parser(sub)
    parser.subparsers = sub.choices  # type: ignore[attr-defined]  # name -> subparser
    return parser


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


def main(argv: list[str] | None = None) -> int:
    """Entry point; configuration errors print one clear message and exit with status 2."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Subparsers stop a positional list at the first option: `run R --nproc 2 k=v` leaves k=v
    # over. Dotted overrides are welcome anywhere; anything else is still an error.
    if extra and hasattr(args, "overrides") and all(_is_override(e) for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        # The subcommand's usage, not the top level's: that is where the typo is.
        sub = parser.subparsers[args.command]  # type: ignore[attr-defined]
        sub.error(f"unrecognized arguments: {' '.join(extra)}{_did_you_mean(sub, extra)}")
    try:
        return args.func(args)
    except (ConfigError, MissingExtraError, RunDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before anything was started: one line, no traceback
        print("interrupted (SIGINT)", file=sys.stderr)
        return 130


def _did_you_mean(sub: argparse.ArgumentParser, extra: list[str]) -> str:
    import difflib

    options = [o for action in sub._actions for o in action.option_strings]
    for word in extra:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""

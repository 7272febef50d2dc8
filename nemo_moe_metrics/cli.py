"""The ``nemo-moe-metrics`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nemo_moe_metrics.config import ConfigError, dump_recipe, load_recipe


def _cmd_check(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    print(dump_recipe(recipe), end="")
    return 0


def _parse_steps(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        if not sep:
            return int(text), int(text)
        return int(first), int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--steps {text!r}: give one step (e.g. 100) or an inclusive window FIRST:LAST"
        ) from None


def _cmd_report(args: argparse.Namespace) -> int:
    # Imported here: matplotlib is only needed by this subcommand.
    from nemo_moe_metrics.report import ReportError, render_report

    try:
        print(render_report(args.run_dir, steps=args.steps))
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subcommand per job."""
    parser = argparse.ArgumentParser(
        prog="nemo-moe-metrics", description="MoE training observability for Megatron-core."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a recipe (with overrides) and print it")
    check.add_argument("recipe", help="YAML recipe, e.g. examples/configs/sft_moe_tiny.yaml")
    check.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    check.set_defaults(func=_cmd_check)
    report = sub.add_parser(
        "report", help="expert-load heatmap, max/ideal plot and a summary from a run's JSONL"
    )
    report.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    report.add_argument(
        "--steps", type=_parse_steps, default=None, help="one step N or a window FIRST:LAST"
    )
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; configuration errors print one clear message and exit with status 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

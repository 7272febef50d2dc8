"""The ``nemo-moe-metrics`` command."""

from __future__ import annotations

import argparse
import sys

from nemo_moe_metrics.config import ConfigError, dump_recipe, load_recipe


def _cmd_check(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    print(dump_recipe(recipe), end="")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from nemo_moe_metrics.launch import run_with_progress

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    return run_with_progress(args.recipe, args.overrides, args.nproc, args.output_dir)


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
    run = sub.add_parser(
        "run", help="train a recipe on local torchrun ranks via nemo-run, with live progress"
    )
    run.add_argument("recipe", help="YAML recipe, e.g. examples/configs/grpo_moe_tiny.yaml")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    run.add_argument("--nproc", type=int, default=2, help="ranks to launch (default 2)")
    run.add_argument(
        "--output-dir", default="runs", help="runs go to DIR/<recipe name>/ (default runs/)"
    )
    run.set_defaults(func=_cmd_run)
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

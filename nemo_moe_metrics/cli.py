"""The ``nemo-moe-metrics`` command."""

from __future__ import annotations

import argparse
import sys

from nemo_moe_metrics.config import ConfigError, dump_recipe, load_recipe


def _cmd_check(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    print(dump_recipe(recipe), end="")
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

"""The ``laneserve`` command line: ``laneserve sim | ...`` (one module per sub-command)."""

from __future__ import annotations

import argparse
import sys

from laneserve import __version__


def build_parser() -> argparse.ArgumentParser:
    from laneserve.commands import bench, calibrate, plan, profile, serve, sim
    parser = argparse.ArgumentParser(prog="laneserve", description=(
        "Length- and SLO-aware LLM serving for prefill/decode disaggregated deployments."))
    parser.add_argument("--version", action="version", version=f"laneserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim.add_parser(sub)
    profile.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    calibrate.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

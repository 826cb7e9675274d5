"""The ``laneserve`` command line: ``laneserve sim | ...`` (one module per sub-command).

A command ends in one line on stderr and a non-zero exit, never a traceback: values are checked
when parsed (:mod:`laneserve.commands.argtypes`), and what a command's own checks did not name
(a ValueError or OSError: exit 2; anything else: exit 1) is printed as one line here, with the
traceback only under ``LANESERVE_TRACEBACK=1``."""

from __future__ import annotations

import argparse
import os
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
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"laneserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:        # a value or a path the command's own checks did not name
        if os.environ.get("LANESERVE_TRACEBACK"):
            raise
        print(f"laneserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback on request
        if os.environ.get("LANESERVE_TRACEBACK"):
            raise
        print(f"laneserve {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(LANESERVE_TRACEBACK=1 shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

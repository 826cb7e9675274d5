"""``laneserve calibrate``: fit the analytic cost model's hardware terms (GEMM efficiency,
FlashAttention kernel, all-reduce, host overhead) to the measured H100/A100 profiles packaged in
``laneserve/costmodel/data`` (or ``--profiles DIR``) and report the fit error
per file (:mod:`laneserve.costmodel.calibrate`)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from laneserve.costmodel.calibrate import add_arguments
    p = sub.add_parser("calibrate", help="fit the cost model's hardware terms to the measured profiles",
                       description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from laneserve.costmodel.calibrate import default_profiles_dir
    from laneserve.costmodel.calibrate import run as calibrate_run
    try:
        args.profiles = args.profiles or default_profiles_dir()
    except FileNotFoundError as exc:
        print(f"error: {exc}")
        return 2
    return calibrate_run(args)

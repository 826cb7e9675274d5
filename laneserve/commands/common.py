"""Pieces shared by the CLI sub-commands."""

from __future__ import annotations

import argparse

from laneserve.core import SLO


def load_workload(args: argparse.Namespace, *, apply_slo_scale: bool):
    """The workload the ``--trace`` / ``--workload`` / ``--workload-opt`` / ``--num-requests`` /
    ``--ttft-slo-ms`` / ``--tpot-slo-ms`` flags name (``--slo-scale`` too when ``apply_slo_scale``;
    the simulator applies it per run instead). The SLO targets arrive in seconds
    (``args.ttft_slo`` / ``args.tpot_slo``). Raises ValueError with a user-facing message."""
    from laneserve.policies.registry import parse_spec
    from laneserve.workloads import load_trace, make_workload
    if args.trace is not None:
        if not args.trace.exists():
            raise ValueError(f"trace file not found: {args.trace}")
        wl = load_trace(args.trace)
    else:
        opts = parse_spec("x:" + ",".join(args.workload_opt))[1] if args.workload_opt else {}
        wl = make_workload(args.workload, **opts)
    if args.num_requests:
        wl = wl.head(args.num_requests)
    if args.ttft_slo is not None or args.tpot_slo is not None:
        wl = wl.with_slo(SLO(args.ttft_slo, args.tpot_slo))
    if apply_slo_scale and args.slo_scale != 1.0:
        wl = wl.scale_slo(args.slo_scale)
    return wl

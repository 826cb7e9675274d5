"""One name and one unit per concept across the commands' flags, and the old spellings kept as
hidden aliases.

Where ``sim``, ``serve``, ``bench`` and ``plan`` share a concept they spell its flag the same way,
in the same unit (vLLM's name where vLLM has the concept):

==========================  =====================================  =================================
concept                     canonical flag (commands)              old spelling (hidden, one release)
==========================  =====================================  =================================
request rate                ``--request-rate`` req/s (sim, bench,   ``--rates``, ``--rate`` (sim);
                            plan)                                  ``--rate`` (plan)
TTFT / TPOT target          ``--ttft-slo-ms`` / ``--tpot-slo-ms``  ``--ttft-slo`` / ``--tpot-slo``
                            in ms (sim, bench, plan; serve's       in seconds
                            ``--default-slo ttft_ms=,tpot_ms=``)
host KV pool                ``--host-kv-tokens`` tokens per        ``--host-kv-blocks`` (serve,
                            decode instance (sim, serve)           blocks of ``--block-size``)
prefill / decode router     ``--router-policy`` /                  ``--router`` / ``--decode-router``
                            ``--decode-router-policy`` (sim,
                            serve; ``--router-policy`` in plan)
tensor parallelism          ``--tensor-parallel-size`` / ``-tp``   ``--tp`` (sim)
                            (sim, serve); per role
                            ``--prefill-tensor-parallel-size``,
                            ``--decode-tensor-parallel-size``
goodput search (sim)        ``--goodput-search``                   ``--goodput`` (bench's
                                                                   ``--goodput`` is vLLM's SLO pairs)
==========================  =====================================  =================================

An old spelling still parses (converted to the canonical unit), is left out of ``--help``, and
says on stderr which flag replaces it.
"""

from __future__ import annotations

import argparse
import sys

from laneserve.commands.argtypes import positive

_positive_seconds = positive(float)        # the old --ttft-slo / --tpot-slo, in seconds


def milliseconds(text: str) -> float:
    """A duration given in milliseconds (finite, above 0), as seconds (what the commands use inside)."""
    return _positive_seconds(text) / 1e3


class _Renamed(argparse.Action):
    """An old spelling of a flag: parsed as before (its ``type`` converts to the canonical unit),
    hidden from ``--help``, and a line on stderr naming the flag that replaces it."""

    def __init__(self, option_strings, dest, canonical: str = "", **kw) -> None:
        # default None: where the canonical flag (added first) shares the dest, its default stands
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kw)
        self.canonical = canonical

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"laneserve: {option_string} is deprecated and will be removed: use {self.canonical}",
              file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def renamed(group, *names: str, canonical: str, dest: str, **kw) -> None:
    """Add ``names`` to ``group`` as a hidden old spelling of ``canonical`` storing into ``dest``
    (``type`` converting to ``canonical``'s unit; ``flag=True`` for a store-true switch)."""
    if kw.pop("flag", False):
        kw.update(nargs=0, const=True)
    group.add_argument(*names, action=_Renamed, canonical=canonical, dest=dest, **kw)


def add_slo_target_flags(group, whom: str) -> None:
    """``--ttft-slo-ms`` / ``--tpot-slo-ms`` (stored in seconds as ``ttft_slo`` / ``tpot_slo``),
    and the old ``--ttft-slo`` / ``--tpot-slo`` in seconds."""
    for name in ("ttft", "tpot"):
        group.add_argument(f"--{name}-slo-ms", dest=f"{name}_slo", type=milliseconds, default=None, metavar="MS",
                           help=f"{name.upper()} target in milliseconds for {whom}")
        renamed(group, f"--{name}-slo", canonical=f"--{name}-slo-ms (milliseconds)", dest=f"{name}_slo",
                type=_positive_seconds)

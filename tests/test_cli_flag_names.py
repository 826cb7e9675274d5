"""One name and one unit per concept across the flags of ``sim``, ``serve``, ``bench`` and ``plan``
(laneserve/commands/flag_names.py): the commands that share a concept show the same canonical
flag in ``--help``, and each old spelling still parses, hidden, to the same value in the
canonical unit."""

from __future__ import annotations

import argparse
import re

import pytest

from laneserve.cli import build_parser

PARSER = build_parser()
SUBPARSERS = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices

# concept: (canonical flag, {command: the attribute it parses into})
CONCEPTS = {
    "request rate (req/s)": ("--request-rate", {"sim": "rates", "bench": "request_rate", "plan": "rate"}),
    "TTFT target (ms)": ("--ttft-slo-ms", {"sim": "ttft_slo", "bench": "ttft_slo", "plan": "ttft_slo"}),
    "TPOT target (ms)": ("--tpot-slo-ms", {"sim": "tpot_slo", "bench": "tpot_slo", "plan": "tpot_slo"}),
    "host KV pool (tokens)": ("--host-kv-tokens", {"sim": "host_kv_tokens", "serve": "host_kv_tokens"}),
    "prefill router": ("--router-policy", {"sim": "router", "serve": "router", "plan": "router"}),
    "decode router": ("--decode-router-policy", {"sim": "decode_router", "serve": "decode_router"}),
    "tensor parallelism": ("--tensor-parallel-size", {"sim": "tp", "serve": "tensor_parallel_size"}),
    "requests used": ("--num-requests", {"sim": "num_requests", "bench": "num_requests", "plan": "num_requests"}),
    "attainment target": ("--target", {"sim": "target", "bench": "target", "plan": "target"}),
    "progress bar off": ("--no-progress", {"sim": "no_progress", "bench": "no_progress", "plan": "no_progress"}),
}

# (command, old spelling, canonical spelling): the same value once parsed
RENAMED = [
    ("sim", ["--rates", "1,2.5"], ["--request-rate", "1,2.5"]),
    ("sim", ["--ttft-slo", "0.6", "--tpot-slo", "0.015"], ["--ttft-slo-ms", "600", "--tpot-slo-ms", "15"]),
    ("sim", ["--router", "least-loaded"], ["--router-policy", "least-loaded"]),
    ("sim", ["--decode-router", "tpot-aware"], ["--decode-router-policy", "tpot-aware"]),
    ("sim", ["--tp", "4"], ["--tensor-parallel-size", "4"]),
    ("sim", ["--tp", "4"], ["-tp", "4"]),
    ("sim", ["--goodput"], ["--goodput-search"]),
    ("bench", ["--ttft-slo", "0.25", "--tpot-slo", "0.05"], ["--ttft-slo-ms", "250", "--tpot-slo-ms", "50"]),
    ("plan", ["--ttft-slo", "2", "--tpot-slo", "0.1"], ["--ttft-slo-ms", "2000", "--tpot-slo-ms", "100"]),
    ("plan", ["--rate", "20"], ["--request-rate", "20"]),
    ("plan", ["--router", "least-loaded"], ["--router-policy", "least-loaded"]),
    ("serve", ["--router", "least-loaded"], ["--router-policy", "least-loaded"]),
    ("serve", ["--decode-router", "least-loaded"], ["--decode-router-policy", "least-loaded"]),
]


def _canonical(command: str, dest: str) -> str:
    """The first long flag ``--help`` shows for ``dest`` in ``command``."""
    shown = [a for a in SUBPARSERS[command]._actions if a.dest == dest and a.help is not argparse.SUPPRESS]
    assert len(shown) == 1, f"{command}: {len(shown)} visible flags store {dest}"
    return next(o for o in shown[0].option_strings if o.startswith("--"))


def _visible(command: str) -> set[str]:
    return {o for a in SUBPARSERS[command]._actions if a.help is not argparse.SUPPRESS for o in a.option_strings}


def _hidden(command: str) -> set[str]:
    return {o for a in SUBPARSERS[command]._actions if a.help is argparse.SUPPRESS for o in a.option_strings}


def _parse(command: str, argv: list[str]) -> argparse.Namespace:
    return PARSER.parse_args([command, *argv])


@pytest.mark.parametrize("concept", sorted(CONCEPTS))
def test_the_commands_agree_on_each_concepts_canonical_flag(concept):
    flag, dests = CONCEPTS[concept]
    assert {cmd: _canonical(cmd, dest) for cmd, dest in dests.items()} == dict.fromkeys(dests, flag)


@pytest.mark.parametrize("command,old,new", RENAMED, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_an_old_spelling_parses_to_the_canonical_value(command, old, new):
    got_old, got_new = vars(_parse(command, old)), vars(_parse(command, new))
    got_old.pop("func"), got_new.pop("func")
    assert got_old == got_new
    assert old[0] in _hidden(command) and old[0] not in _visible(command)
    assert new[0] in _visible(command)


def test_slo_targets_are_milliseconds_held_in_seconds():
    for command in ("sim", "bench", "plan"):
        args = _parse(command, ["--ttft-slo-ms", "600", "--tpot-slo-ms", "15"])
        assert (args.ttft_slo, args.tpot_slo) == (0.6, 0.015)
        args = _parse(command, ["--ttft-slo", "0.6", "--tpot-slo", "0.015"])         # the old flags: seconds
        assert (args.ttft_slo, args.tpot_slo) == (0.6, 0.015)
        args = _parse(command, [])
        assert (args.ttft_slo, args.tpot_slo) == (None, None)
    with pytest.raises(SystemExit):
        _parse("sim", ["--ttft-slo-ms", "fast"])


def test_old_and_new_slo_flags_give_the_workload_the_same_slos():
    from laneserve.commands.common import load_workload
    specs = {}
    for argv in (["--ttft-slo", "0.5", "--tpot-slo", "0.04"], ["--ttft-slo-ms", "500", "--tpot-slo-ms", "40"]):
        wl = load_workload(_parse("sim", ["--num-requests", "20", *argv]), apply_slo_scale=False)
        specs[argv[0]] = [(s.slo.ttft, s.slo.tpot) for s in wl.specs]
    assert specs["--ttft-slo"] == specs["--ttft-slo-ms"] == [(0.5, 0.04)] * 20


def test_sim_single_rate_alias_sweeps_that_rate():
    from laneserve.commands.sim import _rates
    assert _rates(_parse("sim", ["--rate", "3"]), None) == _rates(_parse("sim", ["--request-rate", "3"]), None) == [3.0]


def test_plan_rate_alias_still_excludes_a_budget():
    with pytest.raises(SystemExit):
        _parse("plan", ["--rate", "1", "--budget", "2"])
    assert _parse("plan", ["--budget", "2"]).rate is None


@pytest.mark.parametrize("block_size,old,new", [(16, "4", "64"), (32, "4", "128"), (16, "0", "0")])
def test_serve_host_kv_blocks_alias_is_tokens_over_the_block_size(block_size, old, new):
    from laneserve.commands.serve import build_server
    engines = []
    for argv in (["--host-kv-blocks", old], ["--host-kv-tokens", new]):
        args = _parse("serve", ["--stub", "--block-size", str(block_size), *argv])
        _, cluster = build_server(args, log=lambda s: None)
        engines.append(cluster.spec.engine)
    assert engines[0] == engines[1] and engines[0]["num_host_blocks"] == int(old)


def test_serve_host_kv_tokens_round_down_to_whole_blocks_and_exclude_the_old_flag():
    from laneserve.commands.serve import host_kv_blocks
    assert host_kv_blocks(_parse("serve", ["--host-kv-tokens", "70"])) == 4                  # 16-token blocks
    assert host_kv_blocks(_parse("serve", [])) == 0
    with pytest.raises(ValueError, match="--host-kv-blocks .* --host-kv-tokens"):
        host_kv_blocks(_parse("serve", ["--host-kv-blocks", "2", "--host-kv-tokens", "32"]))


def test_an_old_spelling_says_what_replaces_it(capsys):
    _parse("sim", ["--rates", "2"])
    assert "--rates is deprecated" in capsys.readouterr().err
    _parse("sim", ["--request-rate", "2"])
    assert capsys.readouterr().err == ""


def test_help_shows_only_the_canonical_spellings():
    for command, old in (("sim", "--rates"), ("sim", "--ttft-slo"), ("sim", "--goodput"), ("serve", "--host-kv-blocks"),
                         ("serve", "--router"), ("plan", "--rate"), ("bench", "--tpot-slo")):
        text = SUBPARSERS[command].format_help()
        assert not re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", text), (command, old)

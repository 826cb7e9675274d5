"""Policy options as frozen typed dataclasses (policies/options.py) and the registry reading specs
through them."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from laneserve.cli import main
from laneserve.core.kv import KVCacheManager
from laneserve.policies import registry
from laneserve.policies.colocated import ColocatedOptions, ColocatedScheduler
from laneserve.policies.decode.adaptive import AdaptiveDecodeOptions
from laneserve.policies.decode.alignedserve import AlignedServeOptions
from laneserve.policies.decode.base import DecodeOptions
from laneserve.policies.decode.continuous import ContinuousBatchingDecode
from laneserve.policies.options import PolicyOptions, parse_option
from laneserve.policies.prefill.adaptive import AdaptivePrefill, AdaptivePrefillOptions
from laneserve.policies.prefill.base import PrefillOptions
from laneserve.policies.prefill.cp_edf import ChunkedEDFOptions, ChunkedEDFPrefill
from laneserve.policies.prefill.fcfs import FCFSPrefill
from laneserve.policies.prefill.sedf import SEDFOptions, SEDFPrefill
from laneserve.policies.prefill.mechanisms.priority import ORDERINGS, Ordering
from laneserve.policies.routing import CacheAwareOptions, CacheAwareRouter, RoundRobinRouter


def kv() -> KVCacheManager:
    return KVCacheManager(256, 16)


def test_options_are_frozen():
    opts = SEDFOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.chunk = 4096                                  # type: ignore[misc]
    sched = FCFSPrefill(kv(), token_budget=1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sched.options.token_budget = 1                     # type: ignore[misc]


def test_options_extend_their_parents():
    # adaptive composes S-EDF's mechanisms instead of deriving from the reproduction: its options
    # extend the generic base and declare S-EDF's fields, with S-EDF's defaults but one, themselves
    assert issubclass(AdaptivePrefillOptions, PrefillOptions)
    assert not issubclass(AdaptivePrefillOptions, SEDFOptions)
    assert not issubclass(AdaptiveDecodeOptions, AlignedServeOptions)
    assert issubclass(AdaptiveDecodeOptions, DecodeOptions)
    flow, adaptive = dataclasses.asdict(SEDFOptions()), dataclasses.asdict(AdaptivePrefillOptions())
    assert flow.pop("bound_late") is True and adaptive.pop("bound_late") is False   # late parked tasks
    assert flow.items() <= adaptive.items()
    aligned, adaptive = dataclasses.asdict(AlignedServeOptions()), dataclasses.asdict(AdaptiveDecodeOptions())
    assert aligned.items() <= adaptive.items()
    assert issubclass(SEDFOptions, PrefillOptions)
    assert issubclass(ChunkedEDFOptions, PrefillOptions)
    # a subclass may change a parent's default: S-EDF's budget G is 4096, a plain prefill's 8192
    assert SEDFOptions().token_budget == 4096 and PrefillOptions().token_budget == 8192
    assert AdaptivePrefillOptions().token_budget == 4096


@pytest.mark.parametrize(("cls", "kwargs", "field"), [
    (PrefillOptions, {"token_budget": 0}, "token_budget"),
    (PrefillOptions, {"max_batch_size": -1}, "max_batch_size"),
    (ChunkedEDFOptions, {"chunk": 0}, "chunk"),
    (SEDFOptions, {"ordering": "lifo"}, "ordering"),
    (SEDFOptions, {"preemption": "kernel"}, "preemption"),
    (SEDFOptions, {"max_suspension": 0.0}, "max_suspension"),
    (AdaptivePrefillOptions, {"min_share": 0.5}, "min_share"),
    (AdaptivePrefillOptions, {"window": 0}, "window"),
    (DecodeOptions, {"preemption": "drop"}, "preemption"),
    (CacheAwareOptions, {"threshold": 1.5}, "threshold"),
    (ColocatedOptions, {"prefill": "nope"}, "prefill"),
    # wrong types
    (PrefillOptions, {"token_budget": "2048"}, "token_budget"),
    (PrefillOptions, {"token_budget": 2048.0}, "token_budget"),
    (PrefillOptions, {"prefix_caching": 1}, "prefix_caching"),
    (SEDFOptions, {"batching": "yes"}, "batching"),
    (CacheAwareOptions, {"balance_tokens": True}, "balance_tokens"),
])
def test_validation_errors_name_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"option {field}\b"):
        cls(**kwargs)


def test_choices_errors_list_the_allowed_values():
    with pytest.raises(ValueError, match="one of sedf, dedf, edf, fcfs"):
        SEDFOptions(ordering="lifo")
    assert set(get_args(Ordering)) == set(ORDERINGS)


def test_ints_given_for_floats_become_floats():
    opts = SEDFOptions(max_suspension=5)
    assert opts.max_suspension == 5.0 and type(opts.max_suspension) is float


def test_keyword_and_options_construction_agree():
    cases = [
        (FCFSPrefill, {"token_budget": 1024, "max_batch_size": 8}),
        (ChunkedEDFPrefill, {"chunk": 4096}),
        (SEDFPrefill, {"ordering": "dedf", "preemption": "layer", "max_suspension": 2.5}),
        (AdaptivePrefill, {"boundary": 128, "lanes": False, "token_budget": 2048}),
        (ContinuousBatchingDecode, {"max_batch_size": 16, "preemption": "recompute"}),
    ]
    for cls, kwargs in cases:
        by_keywords = cls(kv(), **kwargs)
        by_value = cls(kv(), cls.Options(**kwargs))
        assert type(by_keywords.options) is cls.Options
        assert by_keywords.options == by_value.options
        assert by_keywords.name == by_value.name
    router = CacheAwareRouter(threshold=0.3)
    assert router.options == CacheAwareRouter(CacheAwareOptions(threshold=0.3)).options
    assert router.threshold == 0.3


def test_keywords_replace_fields_of_an_options_value():
    sched = SEDFPrefill(kv(), SEDFOptions(ordering="edf", chunk=512), chunk=1024)
    assert sched.options == SEDFOptions(ordering="edf", chunk=1024)
    assert sched.chunk_size == 1024 and sched.ordering.name == "edf"


def test_construction_rejects_unknown_options_and_foreign_values():
    with pytest.raises(ValueError, match=r"unknown option 'bogus'.*token_budget=8192"):
        FCFSPrefill(kv(), bogus=1)
    with pytest.raises(TypeError, match="SEDFOptions"):
        SEDFPrefill(kv(), PrefillOptions())
    with pytest.raises(ValueError, match="unknown option"):
        RoundRobinRouter(period=2)


def test_derived_default_follows_the_chunk():
    assert ChunkedEDFOptions(chunk=8192).token_budget == 8192
    assert ChunkedEDFOptions(chunk=8192, token_budget=1024).token_budget == 1024
    assert ChunkedEDFPrefill(kv(), chunk=4096).token_budget == 4096


def test_runtime_objects_are_constructor_arguments_not_options():
    sched = SEDFPrefill(kv(), predictor=lambda tokens: 0.001 * tokens)
    assert sched.predict(1000) == 1.0
    assert "predictor" not in {f.name for f in dataclasses.fields(sched.options)}


def test_unconverted_subclasses_keep_taking_keywords():
    """A policy without Options of its own (as Kairos and LAPS were) consumes its own keywords and
    passes its parent's options up as keywords; it gets its parent's Options."""
    class LegacyPrefill(FCFSPrefill):
        def __init__(self, kv, *, depth: int = 3, **opts) -> None:
            opts.setdefault("token_budget", 1000 * depth)
            super().__init__(kv, **opts)

    class LegacyDecode(ContinuousBatchingDecode):
        def __init__(self, kv, *, host_pool=None, max_batch_size: int = 256, preemption: str = "swap",
                     pace: bool = False) -> None:
            super().__init__(kv, max_batch_size=max_batch_size, preemption=preemption, host_pool=host_pool)

    p = LegacyPrefill(kv(), depth=2, max_batch_size=7)
    assert p.options == PrefillOptions(token_budget=2000, max_batch_size=7) and p.token_budget == 2000
    d = LegacyDecode(kv(), max_batch_size=5, pace=True)
    assert d.options == DecodeOptions(max_batch_size=5) and d.max_batch_size == 5


def test_colocated_specs_forward_other_options_to_the_prefill_policy():
    _, opts = registry.resolve("colocated", "colocated:prefill=cp-edf,chunk=16,token_budget=64")
    assert opts == {"prefill": "cp-edf", "chunk": 16, "token_budget": 64}
    co = registry.make("colocated", "colocated:prefill=cp-edf,chunk=16,token_budget=64", kv())
    assert co.token_budget == 64 and co.prefill.options == ChunkedEDFOptions(chunk=16)
    assert registry.options("colocated", "colocated:prefill=cp-edf,chunk=16") == ColocatedOptions(prefill="cp-edf")
    with pytest.raises(ValueError, match=r"unknown option 'chnk'.*chunk=2048"):
        registry.resolve("colocated", "colocated:prefill=cp-edf,chnk=16")
    with pytest.raises(ValueError, match=r"option chunk expects int"):
        registry.resolve("colocated", "colocated:chunk=x")          # the default prefill is cp-edf
    assert "other options go to its prefill policy" in "\n".join(registry.describe("colocated"))


def test_colocated_forwards_other_keywords_to_its_prefill_policy():
    caching = KVCacheManager(64, 16)
    co = ColocatedScheduler(caching, prefill="fcfs", token_budget=512, max_batch_size=3)
    assert co.options == ColocatedOptions(prefill="fcfs", token_budget=512)
    assert co.prefill.options == PrefillOptions(max_batch_size=3)


# ---- the registry -------------------------------------------------------------------------------
def test_registry_rejects_unknown_options_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option 'chnk'.*valid options.*chunk=2048") as exc:
        registry.resolve("prefill", "cp-edf:chnk=3")
    assert "token_budget=None" in str(exc.value) and "max_batch_size=256" in str(exc.value)
    with pytest.raises(ValueError, match=r"unknown option 'bogus'.*threshold=0.5"):
        registry.make("router", "cache-aware:bogus=1")


def test_registry_rejects_wrongly_typed_values():
    with pytest.raises(ValueError, match=r"option chunk expects int, got 'abc'"):
        registry.resolve("prefill", "cp-edf:chunk=abc")
    with pytest.raises(ValueError, match=r"option batching expects bool"):
        registry.resolve("prefill", "sedf:batching=maybe")
    with pytest.raises(ValueError, match=r"option ordering must be one of"):
        registry.make("prefill", "adaptive:ordering=lifo", kv())
    with pytest.raises(ValueError, match=r"option chunk must be >= 1"):
        registry.resolve("prefill", "cp-edf-2k:chunk=0")


def test_spec_values_are_read_as_the_field_type():
    assert parse_option(SEDFOptions, "max_suspension", "5") == 5.0
    assert parse_option(SEDFOptions, "preemption", "none") == "none"
    assert parse_option(ChunkedEDFOptions, "token_budget", "none") is None
    assert parse_option(ColocatedOptions, "decode", "2048") == "2048"
    assert registry.options("colocated", "colocated:prefill=sedf,decode=fcfs") == \
        ColocatedOptions(prefill="sedf", decode="fcfs")


@pytest.mark.parametrize(("kind", "spec", "expected"), [
    ("prefill", "cp-edf-2k", ChunkedEDFOptions(chunk=2048)),
    ("prefill", "cp-edf-8k", ChunkedEDFOptions(chunk=8192, token_budget=8192)),
    ("prefill", "cp-edf-8k:token_budget=1024", ChunkedEDFOptions(chunk=8192, token_budget=1024)),
    ("prefill", "dedf", SEDFOptions(ordering="dedf")),
    ("prefill", "sedf-nobatch", SEDFOptions(batching=False)),
    ("prefill", "sedf-g8k", SEDFOptions(token_budget=8192)),
    ("prefill", "sedf-chunk:chunk=1024", SEDFOptions(preemption="chunk", chunk=1024)),
    ("prefill", "flowprefill", SEDFOptions()),
    ("decode", "vllm", DecodeOptions()),
    ("router", "cache-aware:threshold=1", CacheAwareOptions(threshold=1.0)),
    ("router", "rr", PolicyOptions()),
])
def test_presets_resolve_to_their_options(kind, spec, expected):
    assert registry.options(kind, spec) == expected


def test_a_built_policy_holds_the_options_its_spec_names():
    sched = registry.make("prefill", "sedf-layer:max_suspension=3", kv())
    assert sched.options == SEDFOptions(preemption="layer", max_suspension=3.0)
    assert sched.name == "sedf-g4096-layer"


def test_bad_presets_fail_at_registration():
    with pytest.raises(ValueError, match=r"preset 'broken'.*unknown option 'chunks'"):
        registry.register("prefill", "broken-cp", aliases={"broken": {"chunks": 1}})(ChunkedEDFPrefill)
    assert "broken-cp" not in registry.available("prefill")


def test_listing_shows_options_with_types_and_defaults_and_presets(capsys):
    lines = {line.split(":", 1)[0]: line for line in registry.describe("prefill")}
    assert "chunk: int = 2048" in lines["cp-edf"] and "cp-edf-8k (chunk=8192)" in lines["cp-edf"]
    assert "ordering: sedf|dedf|edf|fcfs = sedf" in lines["sedf"]
    assert "max_suspension: float = 10.0" in lines["adaptive"] and "min_share: float = 0.05" in lines["adaptive"]
    routers = "\n".join(registry.describe("router"))
    assert "threshold: float = 0.5" in routers and "round-robin: no options; presets: rr" in routers
    assert main(["sim", "--list-policies"]) == 0
    out = capsys.readouterr().out
    assert "cp-edf: token_budget: int | None = None" in out
    assert "continuous: max_batch_size: int = 256, preemption: swap|recompute = swap" in out


def test_registering_a_policy_needs_options():
    class NoOptions:
        name = "no-options"

    with pytest.raises(TypeError, match="has no Options"):
        registry.register("router", "no-options")(NoOptions)
    assert "no-options" not in registry.available("router")

"""``laneserve profile -tp 2``: profiles a two-rank instance (rank 0 here, rank 1 spawned and
stopped at the end), records the degree and the instance's KV bytes (every rank's heads), and the
simulator's ``engine="laneserve"`` / fitted models take it for a TP2 instance only."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from tp_support import tp_checkpoint

from laneserve.cli import main
from laneserve.costmodel import make_cost_model
from laneserve.costmodel.profile import Profile, load_profile


@pytest.fixture(scope="module")
def tp2_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "tp2.json"
    rc = main(["profile", "--model", str(tp_checkpoint("llama")), "-tp", "2", "--kv-tokens", "2048",
               "--repeats", "1", "--threads", "1", "--output", str(out)])
    assert rc == 0
    return out


def test_the_profile_records_the_degree_and_the_instance_kv(tp2_profile):
    from laneserve.engine.models.config import ModelConfig
    prof = load_profile(tp2_profile)
    assert prof.tensor_parallel_size == 2
    assert prof.prefill and prof.decode and prof.kv_copy and all(s.seconds > 0 for s in prof.decode)
    # two KV heads, one per rank: the instance holds exactly the model's KV per token
    full = ModelConfig.from_folder(tp_checkpoint("llama")).kv_bytes_per_token(4)
    assert prof.kv_bytes_per_token == full
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("laneserve-tp-rank")]


def test_the_simulator_takes_a_tp_profile_for_that_degree_only(tp2_profile):
    for cm in (make_cost_model("fitted", profile=str(tp2_profile), tp=2),
               make_cost_model("analytic", engine="laneserve", profile=str(tp2_profile), tp=2)):
        assert cm.decode_step_time([64] * 4) > 0 and cm.prefill_time([(64, 0)]) > 0
    with pytest.raises(ValueError, match="measured a tensor parallel size 2 instance, the simulation asks for 1"):
        make_cost_model("fitted", profile=str(tp2_profile))
    with pytest.raises(ValueError, match="laneserve profile -tp 4"):
        make_cost_model("analytic", engine="laneserve", profile=str(tp2_profile), tp=4)


def test_a_profile_without_a_degree_is_one_rank_and_a_bad_degree_is_refused(tp2_profile):
    data = json.loads(tp2_profile.read_text())
    del data["tensor_parallel_size"]
    assert Profile.from_dict(data).tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        Profile.from_dict({**data, "tensor_parallel_size": 0})

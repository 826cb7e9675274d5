"""``vllm serve`` command lines, as vLLM's documentation writes them, on ``laneserve serve``: each
parses, Hugging Face ids come from the local Hugging Face cache (a fake one here, never the
network), and the flags mean what they mean in vLLM where laneserve has the concept."""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest

from laneserve.cli import build_parser
from laneserve.commands.serve import build_server, make_defaults
from laneserve.commands.vllm_flags import apply_vllm_flags, resolve_model
from laneserve.engine.smoke import smoke_model_path

# from vLLM's documentation (quickstart, OpenAI-compatible server, CLI guide, tool calling, engine args)
VLLM_SERVE_LINES = [
    "vllm serve facebook/opt-125m",
    "vllm serve meta-llama/Llama-2-7b-hf --port 8100",
    "vllm serve facebook/opt-125m --host 0.0.0.0 --port 8080",
    "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
    "vllm serve meta-llama/Llama-3.2-1B-Instruct --dtype auto --max-model-len 4096 --trust-remote-code",
    "vllm serve mistralai/Mistral-7B-v0.1 --gpu-memory-utilization 0.95 --max-model-len 8192",
    "vllm serve meta-llama/Llama-2-7b-hf --enable-prefix-caching",
    "vllm serve meta-llama/Llama-2-70b-hf --tensor-parallel-size 4",
    "vllm serve meta-llama/Llama-3.1-8B-Instruct --enable-auto-tool-choice --tool-call-parser llama3_json "
    "--chat-template examples/tool_chat_template_llama3.1_json.jinja",
    "vllm serve HuggingFaceTB/SmolLM3-3B --enable-auto-tool-choice --tool-call-parser=hermes",
    "vllm serve ./merged --gpu-memory-utilization=0.8 --port 6002 --served-model-name=VLINSTRUCT "
    "--trust-remote-code --max-model-len 8192 --disable-log-requests",
    "vllm serve --model NousResearch/Hermes-3-Llama-3.1-70B-FP8 --dtype auto --max-model-len 131072 "
    "--enable-auto-tool-choice --tool-call-parser hermes --gpu-memory-utilization 0.90 --max-num-seqs 4",
    "vllm serve Qwen/Qwen2.5-0.5B-Instruct --served-model-name qwen qwen2.5 --block-size 32 --enforce-eager "
    "--no-enable-prefix-caching --uvicorn-log-level info -tp 1 --max-num-batched-tokens 8192",
]


def _parse(line: str) -> argparse.Namespace:
    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"]
    return build_parser().parse_args(["serve", *words[2:]])


@pytest.mark.parametrize("line", VLLM_SERVE_LINES)
def test_vllm_serve_lines_parse(line):
    args = _parse(line)
    assert args.func.__name__ == "run"
    assert (args.model_tag or args.model) is not None


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A local Hugging Face cache holding the smoke checkpoint under every id of the lines above."""
    import huggingface_hub.constants as hub
    smoke = smoke_model_path()
    for line in VLLM_SERVE_LINES:
        args = _parse(line)
        repo_id = args.model_tag or str(args.model)
        if "/" not in repo_id or repo_id.startswith("."):
            continue
        repo = tmp_path / f"models--{repo_id.replace('/', '--')}"
        snap = repo / "snapshots" / ("0" * 40)
        snap.mkdir(parents=True, exist_ok=True)
        for f in smoke.iterdir():
            if not (snap / f.name).exists():
                os.symlink(f, snap / f.name)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def _applied(line: str, logs: list[str] | None = None) -> argparse.Namespace:
    args = _parse(line)
    apply_vllm_flags(args, (logs if logs is not None else []).append)
    return args


def test_hugging_face_ids_come_from_the_local_cache_only(hf_cache):
    path = resolve_model("facebook/opt-125m")
    assert path.is_relative_to(hf_cache) and (path / "config.json").is_file()
    with pytest.raises(ValueError, match="neither a folder nor in the local Hugging Face cache.*never downloads"):
        resolve_model("someone/not-cached")
    with pytest.raises(ValueError, match="model folder not found"):
        resolve_model("./no-such-folder")
    args = _applied(VLLM_SERVE_LINES[0])
    assert args.served_model_name == "facebook/opt-125m"          # served under the id, as vLLM
    app, _ = build_server(_parse(VLLM_SERVE_LINES[0]), log=lambda s: None)
    assert app.state.model_name == "facebook/opt-125m" and Path(app.state.model_path).is_relative_to(hf_cache)


def test_the_flags_mean_what_they_mean_in_vllm(hf_cache, tmp_path):
    with pytest.raises(ValueError, match="131072 is more than the model's max_position_embeddings"):
        _applied(VLLM_SERVE_LINES[11])                 # the smoke checkpoint stands in: 4096 positions
    logs: list[str] = []
    hermes = _applied(VLLM_SERVE_LINES[11].replace("131072", "2048"), logs)
    assert hermes.decode_policy == "adaptive:max_batch_size=4"     # --max-num-seqs: the decode batch cap
    assert any("--gpu-memory-utilization 0.9 changes nothing" in s for s in logs)
    defaults = make_defaults(hermes)
    assert defaults.tool_parser == "hermes" and defaults.max_model_len == 2048

    qwen = _applied(VLLM_SERVE_LINES[12])
    assert qwen.served_model_name == "qwen" and qwen.served_model_aliases == ("qwen2.5",)
    assert qwen.no_prefix_caching and qwen.block_size == 32 and qwen.uvicorn_log_level == "info"
    app, _ = build_server(_parse(VLLM_SERVE_LINES[12]), log=lambda s: None)
    assert app.state.model_name == "qwen" and app.state.defaults.served_names == ("qwen", "qwen2.5")

    ok = _applied(VLLM_SERVE_LINES[4])
    d = make_defaults(ok)
    assert d.max_model_len == 4096 and ok.dtype == "auto"

    seventy = _applied(VLLM_SERVE_LINES[7])                   # -tp 4: every instance over 4 ranks
    assert (seventy.prefill_tensor_parallel_size, seventy.decode_tensor_parallel_size) == (4, 4)
    with pytest.raises(ValueError, match="no such file"):                      # the template file is not here
        _applied(VLLM_SERVE_LINES[8])
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = _applied(VLLM_SERVE_LINES[8].replace("examples/tool_chat_template_llama3.1_json.jinja", str(template)))
    d = make_defaults(tools)
    assert d.tool_parser == "llama3_json" and d.chat_template == template.read_text()
    inline = _applied("vllm serve facebook/opt-125m --chat-template '{{ messages[0].content }}'")
    assert make_defaults(inline).chat_template == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        _applied("vllm serve facebook/opt-125m --enable-auto-tool-choice")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        _applied("vllm serve facebook/opt-125m --enable-auto-tool-choice --tool-call-parser nope")
    with pytest.raises(ValueError, match="differ"):
        _applied("vllm serve facebook/opt-125m --model meta-llama/Llama-2-7b-hf")
    with pytest.raises(ValueError, match="exclude each other"):
        _applied("vllm serve facebook/opt-125m --enforce-eager --cuda-graphs")
    with pytest.raises(SystemExit):
        _parse("vllm serve facebook/opt-125m --gpu-memory-utilization 1.5")


def test_every_flag_has_one_help_line_and_its_default_once():
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    formatter = serve._get_formatter()
    for action in serve._actions:
        if action.dest == "help":
            continue
        text = formatter._get_help_string(action)
        assert action.help, f"{action.option_strings or action.dest} has no help"
        assert len(re.findall(r"\(default[: ]", text)) <= 1, f"{action.option_strings}: {text!r}"
    assert "(default 256) (default: 256)" not in serve.format_help()

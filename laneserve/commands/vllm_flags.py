"""``vllm serve`` command lines on ``laneserve serve``: the positional MODEL, Hugging Face ids
from the local cache, and vLLM's flags with vLLM's meaning where laneserve has the concept.

What each flag does here:

``MODEL`` (positional) / ``--model``
    a checkpoint folder, or a Hugging Face id looked up in the local Hugging Face cache only
    (``HF_HUB_OFFLINE`` semantics: never a download; an id that is not cached is a clear error).
``--served-model-name A B ...``
    the first name is the one answers carry; requests may name any of them (or none: ``model`` is
    optional, as in vLLM).
``--max-model-len N``
    caps the context a request may use (prompt + output); more than the checkpoint's
    ``max_position_embeddings`` (a GGUF file's ``<arch>.context_length``) is an error.
``--max-num-seqs N``
    the decode policy's ``max_batch_size`` (colocated instances decode with it too); a policy
    without that option logs that the flag changes nothing.
``--block-size N``
    tokens per KV-cache block of every instance.
``--enable-prefix-caching`` / ``--no-enable-prefix-caching``
    the same as laneserve's default / ``--no-prefix-caching``.
``--enforce-eager``
    no CUDA graphs (laneserve's default; refused together with ``--cuda-graphs``).
``--tensor-parallel-size`` / ``-tp``, ``--prefill-tensor-parallel-size``, ``--decode-tensor-parallel-size``
    ranks per instance (one process each, ``laneserve.engine.tp``): every instance, or per role
    (colocated instances use ``-tp``); prefill and decode degrees may differ (the KV hand-off
    reshards the heads).
``--gpu-memory-utilization``
    checked, then ignored with a log line: the KV cache is sized by ``--kv-tokens``.
``--chat-template``
    a file, or the template text itself.
``--enable-auto-tool-choice --tool-call-parser NAME``
    ``laneserve.server.tool_parsers``.
``--trust-remote-code``, ``--disable-log-requests``
    accepted; nothing to change (laneserve runs its own model code and logs no requests).
``--uvicorn-log-level``
    uvicorn's log level.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from laneserve.commands.argtypes import at_least, fraction

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
POSITIVE = at_least(1)
_UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``vllm serve`` that laneserve's own set lacks."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder, GGUF file or Hugging Face id (as vllm serve's positional MODEL; same as --model)")
    v = p.add_argument_group("vllm serve compatibility")
    v.add_argument("--max-model-len", type=POSITIVE, default=None,
                   help="context length a request may use, prompt + output (default: the checkpoint's "
                        "max_position_embeddings)")
    v.add_argument("--max-num-seqs", type=POSITIVE, default=None,
                   help="requests one decode step may hold: the decode policy's max_batch_size (default: the "
                        "policy's own, 256)")
    v.add_argument("--block-size", type=POSITIVE, default=16, help="tokens per KV-cache block")
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse cached leading KV blocks of prompts (default: on; --no-enable-prefix-caching = "
                        "--no-prefix-caching)")
    v.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (laneserve's default already; excludes --cuda-graphs)")
    v.add_argument("--tensor-parallel-size", "-tp", type=POSITIVE, default=1,
                   help="ranks (GPUs) per instance, one process each")
    v.add_argument("--prefill-tensor-parallel-size", type=POSITIVE, default=None,
                   help="ranks per prefill instance (default: --tensor-parallel-size)")
    v.add_argument("--decode-tensor-parallel-size", type=POSITIVE, default=None,
                   help="ranks per decode instance (default: --tensor-parallel-size)")
    v.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                   help="accepted and checked, but the KV cache is sized by --kv-tokens (a log line says so) "
                        "(default: not set)")
    v.add_argument("--chat-template", default=None,
                   help="chat template: a file, or the Jinja text itself (default: the tokenizer's)")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse the model's own tool calls for requests with tools and tool_choice auto "
                        "(needs --tool-call-parser)")
    v.add_argument("--tool-call-parser", default=None,
                   help="the model's tool-call format: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.x), "
                        "mistral; aliases qwen, qwen2_5, llama, llama4_json (default: none)")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; laneserve runs its own model code, never a checkpoint's")
    v.add_argument("--disable-log-requests", action="store_true",
                   help="accepted; laneserve does not log requests")
    v.add_argument("--uvicorn-log-level", default="warning", choices=_UVICORN_LEVELS, help="uvicorn's log level")


def resolve_model(model: str) -> Path:
    """A checkpoint folder for ``model``: the folder itself, or a Hugging Face id's snapshot in
    the local cache (never downloaded); ValueError saying which when neither."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.startswith((".", "/", "~")) or not _HF_ID.match(model):
        raise ValueError(f"model folder not found: {model}")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:                                # pragma: no cover - transformers brings it
        raise ValueError(f"model folder not found: {model} (and huggingface_hub is not installed)") from None
    try:
        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: not usable from the cache
        raise ValueError(f"model {model!r} is neither a folder nor in the local Hugging Face cache ({HF_HUB_CACHE}); "
                         f"laneserve never downloads: fetch it first (huggingface-cli download {model})") from None


def _chat_template(value: str) -> str:
    """The template's text (a file, or the template inline), compiled once to check it."""
    from laneserve.server.templates import compile_check

    path = Path(value).expanduser()
    text = None
    try:
        if path.is_file():
            text = path.read_text()
    except OSError:          # a long inline template is no file name
        pass
    if text is None and ("{{" in value or "{%" in value):
        text = value
    if text is None:
        raise ValueError(f"--chat-template: no such file, and not a Jinja template: {value!r}")
    compile_check(text)
    return text


def _with_option(spec: str, key: str, value: int) -> str:
    name, _, opts = spec.partition(":")
    kept = [o for o in opts.split(",") if o and not o.startswith(f"{key}=")]
    return f"{name}:{','.join([*kept, f'{key}={value}'])}"


def apply_vllm_flags(args: argparse.Namespace, log) -> None:
    """Check vLLM's flags and fold them into laneserve's (``args`` is updated in place; the
    chat template, tool parser, served names and context cap are left for ``make_defaults``)."""
    tag, given = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and given is not None and str(given) != tag:
        raise ValueError(f"the positional MODEL ({tag}) and --model ({given}) differ")
    model = tag if tag is not None else (str(given) if given is not None else None)
    names = args.served_model_name
    names = [names] if isinstance(names, str) else list(names or [])
    if model is not None:
        path = resolve_model(model)
        if not Path(model).expanduser().exists() and not names:
            names = [model]                            # a Hugging Face id: served under that id, as vLLM
        args.model = path
    args.served_model_name = names[0] if names else None
    args.served_model_aliases = tuple(names[1:])
    _tensor_parallel_sizes(args)
    if args.enforce_eager and args.cuda_graphs:
        raise ValueError("--enforce-eager and --cuda-graphs exclude each other")
    if args.enable_prefix_caching is True and args.no_prefix_caching:
        raise ValueError("--enable-prefix-caching and --no-prefix-caching exclude each other")
    if args.enable_prefix_caching is False:
        args.no_prefix_caching = True
    if args.gpu_memory_utilization is not None:
        log(f"laneserve: --gpu-memory-utilization {args.gpu_memory_utilization} changes nothing: each instance's "
            f"KV cache holds --kv-tokens ({args.kv_tokens}) tokens")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.tool_call_parser:
        from laneserve.server.tool_parsers import get_parser
        get_parser(args.tool_call_parser)              # unknown names fail here, listing the known ones
        if not args.enable_auto_tool_choice:
            log("laneserve: --tool-call-parser without --enable-auto-tool-choice: requests with tool_choice "
                "auto are refused")
    args.chat_template_text = _chat_template(args.chat_template) if args.chat_template else None
    if args.max_model_len is not None and args.model is not None:
        limit, what = _context_limit(Path(args.model))
        if limit is not None and args.max_model_len > limit:
            raise ValueError(f"--max-model-len {args.max_model_len} is more than the model's {what} ({limit})")
    if args.max_num_seqs is not None:
        from laneserve.policies import registry
        spec = _with_option(args.decode_policy, "max_batch_size", args.max_num_seqs)
        try:                                      # colocated instances decode with the decode policy too
            registry.resolve("decode", spec)
        except ValueError:
            log(f"laneserve: --max-num-seqs changes nothing: the decode policy {args.decode_policy!r} has no batch "
                "cap (max_batch_size)")
        else:
            args.decode_policy = spec


def _context_limit(model: Path) -> tuple[int | None, str]:
    """The checkpoint's context length and where it comes from: a folder's config.json
    ``max_position_embeddings``, a GGUF file's ``<arch>.context_length``; None when neither says."""
    if model.is_file():                     # the engine's GGUF module (and torch) only for a file
        from laneserve.engine.models.gguf import context_length, is_gguf_file

        if is_gguf_file(model):
            return context_length(model), "GGUF context_length"
    config = model / "config.json"
    limit = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    return limit, "max_position_embeddings"


def _tensor_parallel_sizes(args: argparse.Namespace) -> None:
    """Resolve the per-role degrees into ``args.prefill_tensor_parallel_size`` /
    ``args.decode_tensor_parallel_size``; refuse what the instances cannot run yet."""
    tp = args.tensor_parallel_size
    colocated = getattr(args, "colocated", False)
    if colocated and (args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size):
        raise ValueError("colocated instances take --tensor-parallel-size, not the per-role flags")
    args.prefill_tensor_parallel_size = args.prefill_tensor_parallel_size or tp
    args.decode_tensor_parallel_size = args.decode_tensor_parallel_size or tp
    if getattr(args, "stub", False) and max(args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size) > 1:
        raise ValueError("--stub instances have no engine to shard: drop --tensor-parallel-size")

"""``laneserve serve``: an OpenAI-compatible server over prefill/decode instance processes.

    laneserve serve --model PATH --prefill 1 --decode 1 --prefill-policy adaptive \\
                    --decode-policy adaptive --router-policy round-robin --port 8000
    laneserve serve --colocated                 # one process: API + one colocated engine (smoke model)
    laneserve serve Qwen/Qwen2.5-0.5B-Instruct --max-model-len 4096 --enable-auto-tool-choice \
                    --tool-call-parser hermes   # a vllm serve line (the id from the local HF cache)

This process runs the HTTP API and the router; each instance runs in its own process (bound to a
device from ``--devices``) and talks to the router over ZeroMQ; KV moves prefill -> decode
through shared host memory (``--kv-transport shm``). With ``--ray-address`` the instances are
Ray actors on the nodes of a Ray cluster (control over ZeroMQ/TCP, KV through the object store). ``--colocated`` runs colocated instances
(prefill and decode on one engine); ``--in-process`` runs them as threads of this one process
(no restart after a hard crash, no hang detection). Instances that crash or stop sending
heartbeats are restarted (``--max-restarts``, ``--heartbeat-timeout``); SIGTERM or Ctrl-C stops
admitting and lets running requests finish for up to ``--shutdown-timeout`` seconds. Without ``--model`` the embedded smoke model is used (random
weights: its text is noise). ``--stub`` replaces the engine by an instance that echoes at once —
a measurement harness for the API/router overhead, not a model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from laneserve.commands.argtypes import at_least, fraction
from laneserve.commands.flag_names import renamed
from laneserve.commands.vllm_flags import add_vllm_flags, apply_vllm_flags
from laneserve.runtime.cluster import (DEFAULT_DECODE_POLICY, DEFAULT_DECODE_ROUTER, DEFAULT_PREFILL_POLICY,
                                       DEFAULT_ROUTER)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, every flag with its default once: added unless the help text
    already says it, or there is none to show (None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


_DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32",
                  "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                  "half": "float16"}


def _dtype(text: str) -> str:
    """``--dtype``: vLLM's names and the usual short ones, checked when the command line is read."""
    try:
        return _DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (auto, float32, bfloat16, float16; "
                                         "aliases fp32, bf16, fp16, half)") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server", description=__doc__,
                       formatter_class=_HelpFormatter)
    _add_model_flags(p)
    _add_deployment_flags(p)
    _add_engine_flags(p)
    _add_admission_flags(p)
    _add_robustness_flags(p)
    h = p.add_argument_group("measurement harness")
    h.add_argument("--stub", action="store_true", help="STUB instances that echo immediately (no model)")
    h.add_argument("--stub-token-delay", type=float, default=0.0, help="seconds per token of a stub instance")
    add_vllm_flags(p)
    p.set_defaults(func=run)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint folder or GGUF file, or a Hugging Face id in the local "
                                              "Hugging Face cache (never downloaded) (default: the embedded smoke "
                                              "model)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model id(s) clients may send; answers carry the first (default: the folder name, or the "
                        "Hugging Face id)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder or GGUF file (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="address the API listens on")
    p.add_argument("--port", type=int, default=8000, help="port the API listens on")


def _add_deployment_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("deployment")
    c.add_argument("--prefill", type=at_least(1), default=1,
                   help="prefill instances (colocated instances with --colocated)")
    c.add_argument("--decode", type=at_least(0), default=1, help="decode instances")
    c.add_argument("--colocated", action="store_true",
                   help="colocated instances (prefill and decode on one engine)")
    c.add_argument("--in-process", action="store_true",
                   help="with --colocated: instances as threads of the API process (one process; a hard "
                        "crash takes the server down and a hung instance is not detected)")
    c.add_argument("--prefill-policy", default=DEFAULT_PREFILL_POLICY,
                   help=f"prefill policy spec (default {DEFAULT_PREFILL_POLICY}; laneserve sim --list)")
    c.add_argument("--decode-policy", default=DEFAULT_DECODE_POLICY,
                   help=f"decode policy spec (default {DEFAULT_DECODE_POLICY})")
    c.add_argument("--router-policy", dest="router", default=DEFAULT_ROUTER, help="prefill router")
    renamed(c, "--router", canonical="--router-policy", dest="router")
    c.add_argument("--decode-router-policy", dest="decode_router", default=DEFAULT_DECODE_ROUTER,
                   help="decode router (default auto: the decode policy's own, tpot-aware for adaptive, "
                        "else least-loaded)")
    renamed(c, "--decode-router", canonical="--decode-router-policy", dest="decode_router")
    c.add_argument("--devices", default="cpu", help="comma-separated devices, assigned to instances in turn")
    c.add_argument("--kv-tokens", type=at_least(16), default=65536, help="KV-cache tokens per instance")
    c.add_argument("--kv-transport", default=None,
                   help="prefill->decode KV transport: shm | inline | ray (default: shm; ray with --ray-address)")
    c.add_argument("--ray-address", default=None, metavar="ADDRESS|auto",
                   help="join this Ray cluster and run each instance as an actor on a node offering "
                        "laneserve_prefill / laneserve_decode / laneserve_colocated (README: Across machines)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", type=_dtype, default="auto",
                   help="auto (the checkpoint's dtype on CUDA, float32 on CPU), float32, bfloat16 or float16")
    e.add_argument("--attention", choices=("auto", "ragged", "padded", "paged"), default="auto",
                   help="attention path (auto: the device's default)")
    e.add_argument("--threads", type=at_least(1), default=1, help="torch threads per instance (CPU)")
    e.add_argument("--max-num-batched-tokens", type=at_least(1), default=2048,
                   help="tokens one prefill step may take")
    e.add_argument("--host-kv-tokens", type=at_least(0), default=0,
                   help="host KV pool per decode instance, in tokens (whole --block-size blocks: rounded down)")
    renamed(e, "--host-kv-blocks", canonical="--host-kv-tokens (tokens: blocks x --block-size)",
            dest="host_kv_blocks", type=at_least(0))
    e.add_argument("--seed", type=int, default=0, help="seed of the engine's sampler")
    e.add_argument("--no-prefix-caching", action="store_true",
                   help="keep no prompt KV across requests (default: prefill and colocated instances reuse "
                        "cached leading blocks of a prompt)")
    e.add_argument("--cuda-graphs", action="store_true",
                   help="run decode and LAPS short-prefill steps in static shape buckets: CUDA graphs on "
                        "CUDA, the same static path eagerly on CPU (default: on for CUDA devices, off on CPU; "
                        "--enforce-eager turns them off)")


def _add_admission_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("admission and SLOs")
    a.add_argument("--max-inflight", type=at_least(1), default=256,
                   help="sequences in the system before new requests get 429")
    a.add_argument("--max-queued-tokens", type=at_least(1), default=None,
                   help="prompt tokens waiting for prefill before new requests get 429")
    a.add_argument("--max-request-share", type=fraction, default=0.25,
                   help="the share of --max-inflight slots, and of the decode KV cache, one request may hold "
                        "(more is a 400 naming the limit)")
    a.add_argument("--max-response-bytes", type=at_least(1 << 16), default=64 << 20,
                   help="largest response a request may ask for (estimated from echo, logprobs, prompt_logprobs, "
                        "n and max_tokens before any work; more is a 400)")
    a.add_argument("--default-slo", default="", metavar="ttft_ms=X,tpot_ms=Y",
                   help="SLO of requests that name none")
    a.add_argument("--slo-class", action="append", default=[], metavar="NAME:ttft_ms=X,tpot_ms=Y[,priority=P]",
                   help="a named SLO class with its defaults (repeatable)")
    a.add_argument("--chat-template-timeout", type=at_least(0.01, float), default=2.0,
                   help="seconds one chat-template render may take (a request whose render runs longer gets a 400)")
    a.add_argument("--json-schema-open-objects", action="store_true",
                   help="structured output: an object schema without additionalProperties takes further keys "
                        "(JSON Schema's reading); by default it is closed, as vLLM's default backend does")
    a.add_argument("--default-max-tokens", type=at_least(1), default=256,
                   help="chat completions: max_tokens when the request sets none (capped by the context)")


def _add_robustness_flags(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("robustness and security")
    r.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path that does work (/v1/*, /tokenize, "
                        "/detokenize, /debug/*; not /health, /version, /metrics, the docs) (default: the "
                        "LANESERVE_API_KEY environment variable; none = open)")
    r.add_argument("--api-key-all-paths", action="store_true",
                   help="with an API key: require it on every path, /health and /metrics included")
    r.add_argument("--metrics-require-key", action="store_true",
                   help="with an API key: require it on /metrics too")
    r.add_argument("--metrics-prefix", choices=("laneserve", "vllm", "both"), default="laneserve",
                   help="/metrics names: laneserve's, vLLM's (vllm:*, labels model_name and engine, for vLLM "
                        "dashboards), or both")
    r.add_argument("--max-request-bytes", type=at_least(1024), default=8 << 20,
                   help="larger request bodies get 413 before they are parsed")
    r.add_argument("--header-timeout", type=at_least(0.1, float), default=10.0,
                   help="seconds a connection has to send a request's headers (idle and slow clients are closed)")
    r.add_argument("--keep-alive-timeout", type=at_least(0.1, float), default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    r.add_argument("--body-timeout", type=at_least(0.1, float), default=30.0,
                   help="seconds a request body has to arrive (408 after)")
    r.add_argument("--heartbeat-timeout", type=at_least(0, float), default=10.0,
                   help="seconds without a heartbeat before an instance is declared hung, killed and "
                        "restarted (0 = never)")
    r.add_argument("--max-restarts", type=at_least(0), default=5,
                   help="restarts of a crashed or hung instance (with backoff) before it stays down")
    r.add_argument("--shutdown-timeout", type=at_least(0, float), default=30.0,
                   help="on SIGTERM/SIGINT: seconds running requests get to finish")


def _slo_opts(text: str, what: str) -> dict:
    from laneserve.policies.registry import parse_spec
    opts = parse_spec("x:" + text)[1] if text else {}
    unknown = set(opts) - {"ttft_ms", "tpot_ms", "priority"}
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {', '.join(sorted(unknown))} (use ttft_ms, tpot_ms, priority)")
    return opts


def make_defaults(args: argparse.Namespace):
    from laneserve.core.slo import SLO, SLOClass
    from laneserve.server.protocol import ServerDefaults

    def slo(opts: dict) -> SLO:
        ms = lambda k: None if opts.get(k) is None else float(opts[k]) / 1e3  # noqa: E731
        return SLO(ms("ttft_ms"), ms("tpot_ms"))

    classes = {}
    for item in args.slo_class:
        name, _, rest = item.partition(":")
        opts = _slo_opts(rest, f"--slo-class {item}")
        classes[name.strip()] = SLOClass(name.strip(), slo(opts), int(opts.get("priority", 0)))
    return ServerDefaults(default_slo=slo(_slo_opts(args.default_slo, "--default-slo")), classes=classes,
                          default_max_tokens=args.default_max_tokens,
                          tool_parser=args.tool_call_parser if getattr(args, "enable_auto_tool_choice", False)
                          else None,
                          chat_template=getattr(args, "chat_template_text", None),
                          served_names=tuple(n for n in (getattr(args, "served_model_name", None),
                                                         *getattr(args, "served_model_aliases", ())) if n),
                          max_model_len=getattr(args, "max_model_len", None),
                          open_json_objects=getattr(args, "json_schema_open_objects", False),
                          render_timeout=getattr(args, "chat_template_timeout", 2.0))


def _load_tokenizer(path: Path | None):
    if path is not None and path.is_file():  # a GGUF file: the tokenizer and chat template stored in it
        from laneserve.engine.models.gguf import is_gguf_file, load_gguf_tokenizer
        if not is_gguf_file(path):
            raise ValueError(f"{path} is a file but not a GGUF file; --tokenizer takes a folder or a GGUF file")
        return load_gguf_tokenizer(path)
    if path is None or not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def build_server(args: argparse.Namespace, log=None):
    """(app, cluster) for ``args``; the cluster starts in the app's lifespan."""
    from laneserve.server.api import build_app

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    apply_vllm_flags(args, log)
    model = _model_folder(args, log)
    transport = _check_deployment(args)
    policies = policy_specs(args)
    name = args.served_model_name or (Path(model).name if model is not None else "laneserve-stub")
    args.served_model_name = name              # make_defaults: the name a request without 'model' gets
    engine = _engine_options(args)
    spec = _cluster_spec(args, model, engine, transport, policies)
    if args.ray_address:
        from laneserve.cluster.ray_cluster import RayCluster
        cluster = RayCluster(spec, args.ray_address, log=log)
    else:
        from laneserve.cluster.process import ProcessCluster
        cluster = ProcessCluster(spec, log=log)
    if args.stub:
        log("laneserve: --stub: instances are a MEASUREMENT HARNESS that echo the prompt at once (no model)")
    state = _server_state(args, cluster, name, model)
    lifecycle, lifespan = _lifecycle(args, state, cluster, spec, model, name, log)
    app = build_app(state, lifespan=lifespan)
    app.lifecycle = lifecycle
    return app, cluster


def _model_folder(args: argparse.Namespace, log):
    """The checkpoint folder to serve: ``--model``, else the embedded smoke model (none with --stub)."""
    model = args.model
    if model is None and not args.stub:
        from laneserve.engine.smoke import smoke_model_path
        model = smoke_model_path()
        log(f"laneserve: no --model given: serving the embedded SMOKE model at {model} "
            "(random weights: its text is noise)")
    if model is not None and not Path(model).exists():
        raise ValueError(f"model folder not found: {model}")
    return model


def _check_deployment(args: argparse.Namespace) -> str:
    """Check the deployment flags (process model, KV transport, instance counts; the policies:
    :func:`policy_specs`); the KV transport to use. ValueError naming the flag at fault."""
    from laneserve.cluster.transport import available_transports
    if args.in_process and not args.colocated:
        raise ValueError("--in-process needs --colocated")
    if args.in_process and args.ray_address:
        raise ValueError("--in-process and --ray-address exclude each other")
    transport = args.kv_transport or ("ray" if args.ray_address else "shm")
    if transport not in available_transports():
        raise ValueError(f"unknown --kv-transport {transport!r}; available: {', '.join(available_transports())}")
    if args.ray_address and transport == "shm":
        raise ValueError("--kv-transport shm works on one machine only; with --ray-address use ray or inline")
    if transport == "ray" and not args.ray_address:
        raise ValueError("--kv-transport ray needs --ray-address")
    if args.max_request_bytes < 1024:
        raise ValueError("--max-request-bytes must be at least 1024")
    if args.prefill < 1 or (not args.colocated and args.decode < 1):
        raise ValueError("need at least one prefill and one decode instance (or --colocated)")
    return transport


def policy_specs(args: argparse.Namespace) -> dict:
    """The typed specs of the policy flags (their text is the CLI's syntax only: read here, once,
    and carried typed from here on); ValueError naming the bad option or listing the valid names.
    ``--decode-router-policy auto`` is resolved here to the decode policy's own router."""
    from laneserve.policies import registry
    from laneserve.policies.spec import PolicySpec
    specs = {"prefill_policy": PolicySpec.parse("prefill", args.prefill_policy),
             "decode_policy": PolicySpec.parse("decode", args.decode_policy),
             "router": PolicySpec.parse("router", args.router)}
    specs["decode_router"] = PolicySpec.parse("router", registry.decode_router_for(specs["decode_policy"],
                                                                                   args.decode_router))
    return specs


def host_kv_blocks(args: argparse.Namespace) -> int:
    """Host KV pool blocks per decode instance: ``--host-kv-tokens`` in whole ``--block-size``
    blocks, or the old ``--host-kv-blocks`` as given (not both)."""
    blocks = getattr(args, "host_kv_blocks", None)
    if blocks is None:
        return args.host_kv_tokens // args.block_size
    if args.host_kv_tokens:
        raise ValueError("--host-kv-blocks (deprecated) and --host-kv-tokens exclude each other")
    return blocks


def _engine_options(args: argparse.Namespace) -> dict:
    """Every instance's engine options, checked here for each device (not in each instance process)."""
    engine = {"dtype": args.dtype, "attention": args.attention, "num_threads": args.threads,
              "max_num_batched_tokens": args.max_num_batched_tokens, "num_host_blocks": host_kv_blocks(args),
              "seed": args.seed, "cuda_graphs": True if args.cuda_graphs else False if args.enforce_eager else None, "prefix_caching": not args.no_prefix_caching,
              "block_size": args.block_size}
    if not args.stub:                       # engine options checked here, not in each instance process
        from laneserve.engine.config import EngineConfig
        for device in {d.strip() for d in args.devices.split(",") if d.strip()} or {"cpu"}:
            EngineConfig(device=device, **engine)
    return engine


def _cluster_spec(args: argparse.Namespace, model, engine: dict, transport: str, policies: dict):
    from laneserve.cluster.process import ClusterSpec
    return ClusterSpec(model=str(model) if model is not None else "", num_prefill=args.prefill,
                       num_decode=args.decode, colocated=args.colocated,
                       in_process=args.colocated and args.in_process,
                       **policies, kv_tokens=args.kv_tokens, engine=engine,
                       devices=tuple(d.strip() for d in args.devices.split(",") if d.strip()),
                       transport=transport, worker="stub" if args.stub else "engine",
                       stub_token_delay=args.stub_token_delay, max_inflight=args.max_inflight,
                       max_queued_tokens=args.max_queued_tokens, heartbeat_timeout=args.heartbeat_timeout,
                       max_restarts=args.max_restarts,
                       prefill_tensor_parallel_size=getattr(args, "prefill_tensor_parallel_size", 1) or 1,
                       decode_tensor_parallel_size=getattr(args, "decode_tensor_parallel_size", 1) or 1)


def _server_state(args: argparse.Namespace, cluster, name: str, model):
    from laneserve.server.api import ServerState
    from laneserve.server.budget import RequestBudget
    from laneserve.server.metrics import ServerMetrics
    api_key = args.api_key if args.api_key is not None else os.environ.get("LANESERVE_API_KEY") or None
    return ServerState(cluster, name, str(model or ""), None, make_defaults(args),
                       ServerMetrics(name, getattr(args, "metrics_prefix", "laneserve")),
                       api_key=api_key, protect_all=args.api_key_all_paths,
                       metrics_require_key=getattr(args, "metrics_require_key", False),
                       max_request_bytes=args.max_request_bytes, body_timeout=args.body_timeout,
                       request_budget=RequestBudget(args.max_request_share, args.max_response_bytes))


def _in_daemon_thread(fn, *args):
    """An asyncio future of ``fn(*args)`` run in a daemon thread: a server stopped while it runs
    (during start-up) exits without waiting for it, where ``asyncio.to_thread``'s executor thread
    would be joined first (seconds, for a tokenizer whose import of transformers is under way)."""
    import asyncio
    import contextlib
    import threading

    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, exc) -> None:
        if not future.done():
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)

    def run() -> None:
        try:
            value, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            value, exc = None, e
        with contextlib.suppress(RuntimeError):          # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, value, exc)

    threading.Thread(target=run, daemon=True, name="laneserve-tokenizer").start()
    return future


def _lifecycle(args: argparse.Namespace, state, cluster, spec, model, name: str, log):
    """(Lifecycle, the app's lifespan): start the instances and load the tokenizer once the port
    answers; on the way out drain, close the cluster and the render and parse pools."""
    import asyncio
    import contextlib

    from laneserve.server.lifecycle import Lifecycle

    async def start() -> None:
        from laneserve.server.templates import probe_render

        tok_path = Path(args.tokenizer or model) if (args.tokenizer or model) else None

        async def tokenizer_and_template() -> None:     # a broken template stops start-up here, early
            state.tokenizer = await _in_daemon_thread(_load_tokenizer, tok_path)
            probe_render(state.tokenizer, state.defaults.chat_template, state.defaults.render_timeout)

        if spec.in_process:
            # in-process instances import transformers in their threads, and its lazy imports are not
            # thread-safe: load the tokenizer before they start, not beside them
            await tokenizer_and_template()
            await cluster.start()
        else:
            # processes load while this one loads the tokenizer and checks the template
            starting = asyncio.ensure_future(cluster.start())
            try:
                await tokenizer_and_template()
            except BaseException:
                starting.cancel()                      # the lifespan's exit closes what was started
                with contextlib.suppress(BaseException):
                    await starting
                raise
            await starting
        mode = "colocated" if spec.colocated else f"{spec.num_prefill}P+{spec.num_decode}D"
        log(f"laneserve: serving {name!r} ({mode}, prefill={spec.prefill_policy}, decode={spec.decode_policy}, "
            f"router={spec.router}) on http://{args.host}:{args.port}")

    lifecycle = Lifecycle(state, cluster, start, shutdown_timeout=args.shutdown_timeout, log=log)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        lifecycle.begin()          # the port answers at once: 503 "starting" until the instances are up
        try:
            yield
        finally:
            await lifecycle.end()
            if lifecycle.failure is None:
                log("laneserve: shutting down")
            await cluster.close()
            state.parse_pool.shutdown(wait=False, cancel_futures=True)
            state.render_pool.shutdown(wait=False, cancel_futures=True)

    return lifecycle, lifespan


def run(args: argparse.Namespace) -> int:
    try:
        app, _ = build_server(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handlers it found: make
    # those no-ops so a graceful shutdown ends with exit code 0 rather than a signal or a traceback
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    from laneserve.server.lifecycle import run_server
    return run_server(app, app.lifecycle, host=args.host, port=args.port, header_timeout=args.header_timeout,
                      keep_alive_timeout=args.keep_alive_timeout, log_level=args.uvicorn_log_level)

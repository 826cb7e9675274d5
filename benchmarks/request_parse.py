"""Per-request validation cost in the API process, against an earlier version of the validation:
body bytes -> JSON -> field checks -> tokenization or chat template -> ``GenerateInput``, timed
in-process (no HTTP) on typical requests:

- ``completion_ids``: a completion with a 64-token id prompt and five sampling fields (validation
  only: no tokenizer work);
- ``completion_text``: a ~300-character text prompt and six sampling fields (smoke tokenizer);
- ``chat``: three chat messages through the smoke model's chat template.

The baseline is ``laneserve/server/protocol.py`` as of ``--baseline`` (a git revision; default
5cfb81c, the hand-written checks before the typed request models), loaded from git next to the
current module. Both run in the same process with their rounds interleaved, so load from other
work on the (shared) machine hits both alike; each figure is the fastest of ``--rounds`` rounds of
``--repeats`` calls. ``metrics.<request>_ratio`` = current / baseline time.

    flock /tmp/laneserve-bench.lock .venv/bin/python benchmarks/request_parse.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the checkout this script lives in, not whatever laneserve the environment installs
sys.path.insert(0, str(ROOT))

from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.core.slo import SLO  # noqa: E402
from laneserve.server import protocol  # noqa: E402

SAMPLING = {"max_tokens": 64, "temperature": 0.7, "top_p": 0.95, "seed": 7, "stop": ["\n\n"], "stream": True}
TEXT = "the model serve token prefill decode " * 8


def bodies() -> dict[str, tuple[str, bytes, bool]]:
    return {
        "completion_ids": ("completion", json.dumps({"model": "smoke-llama", "prompt": list(range(10, 74)),
                                                     **{k: v for k, v in SAMPLING.items() if k != "stop"}}).encode(),
                           False),
        "completion_text": ("completion", json.dumps({"model": "smoke-llama", "prompt": TEXT, **SAMPLING}).encode(),
                            True),
        "chat": ("chat", json.dumps({"model": "smoke-llama", **SAMPLING, "messages": [
            {"role": "system", "content": "you are the model"},
            {"role": "user", "content": TEXT},
            {"role": "assistant", "content": "token decode"}]}).encode(), True),
    }


def load_baseline(rev: str):
    """``laneserve/server/protocol.py`` at git revision ``rev``, as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:laneserve/server/protocol.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="laneserve-bench-")) / "baseline_protocol.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_protocol", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def parser(mod, kind: str, raw: bytes, **kw):
    parse = mod.parse_completion if kind == "completion" else mod.parse_chat
    return lambda: parse(mod.parse_body(raw), **kw, defaults=mod.ServerDefaults(default_slo=SLO(1.0, 0.1)))


def mean_call_us(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="5cfb81c", help="git revision of the baseline protocol.py")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    from laneserve.commands.serve import _load_tokenizer
    from laneserve.engine.smoke import smoke_model_path
    tokenizer = _load_tokenizer(smoke_model_path())
    base = load_baseline(args.baseline)
    rows, metrics = [], {}
    for name, (kind, raw, needs_tok) in bodies().items():
        kw = dict(tokenizer=tokenizer if needs_tok else None, max_model_len=4096, vocab_size=1024,
                  kv_tokens=16384, headers={})
        fns = {"current": parser(protocol, kind, raw, **kw), "baseline": parser(base, kind, raw, **kw)}
        assert fns["current"]().prompt_ids == fns["baseline"]().prompt_ids
        best = {k: float("inf") for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                best[k] = min(best[k], mean_call_us(fn, args.repeats))
        ratio = best["current"] / best["baseline"]
        metrics.update({f"{name}_us": round(best["current"], 2), f"{name}_baseline_us": round(best["baseline"], 2),
                        f"{name}_ratio": round(ratio, 3)})
        rows.append({"request": name, "bytes": len(raw), "baseline_us": best["baseline"],
                     "current_us": best["current"], "current/baseline": ratio})
    write_result("request_parse", metrics, markdown=markdown_table(rows),
                 extra={"baseline": args.baseline, "repeats": args.repeats, "rounds": args.rounds})
    print(markdown_table(rows))


if __name__ == "__main__":
    main()

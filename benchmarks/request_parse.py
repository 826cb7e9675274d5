"""Per-request validation cost in the API process: :func:`laneserve.server.api.parse_request`
(body bytes -> JSON -> field checks -> tokenization or chat template -> ``GenerateInput``) on
typical requests, timed in-process (no HTTP), median of repeated runs.

- ``completion_ids``: a completion with a 64-token id prompt and six sampling fields (validation
  only: no tokenizer work);
- ``completion_text``: the same with a ~300-character text prompt (smoke tokenizer);
- ``chat``: three chat messages through the smoke model's chat template.

    flock /tmp/laneserve-bench.lock .venv/bin/python benchmarks/request_parse.py [--label NAME]

``--label`` names the result (``request_parse_<label>``), to compare two versions of the code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.core.slo import SLO  # noqa: E402
from laneserve.server.api import parse_request  # noqa: E402
from laneserve.server.protocol import ServerDefaults  # noqa: E402

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


def time_us(fn, repeats: int, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean time per call of ``repeats`` calls, in microseconds."""
    fn()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        per.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="", help="suffix of the result name")
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    from laneserve.commands.serve import _load_tokenizer
    from laneserve.engine.smoke import smoke_model_path
    tokenizer = _load_tokenizer(smoke_model_path())
    defaults = ServerDefaults(default_slo=SLO(1.0, 0.1))
    rows, metrics = [], {}
    for name, (kind, raw, needs_tok) in bodies().items():
        kw = dict(tokenizer=tokenizer if needs_tok else None, max_model_len=4096, vocab_size=1024,
                  kv_tokens=16384, headers={}, defaults=defaults)
        gi = parse_request(kind, raw, **kw)
        assert gi.prompt_ids
        us = time_us(lambda: parse_request(kind, raw, **kw), args.repeats)
        metrics[f"{name}_us"] = round(us, 2)
        rows.append({"request": name, "bytes": len(raw), "parse_us": us})
    name = "request_parse" + (f"_{args.label}" if args.label else "")
    write_result(name, metrics, markdown=markdown_table(rows))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()

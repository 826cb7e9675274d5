"""Router-side cost of the typed wire codec: decoding one step's ``Tokens`` message (one item per
request with news; msgspec Structs, every field type-checked) against a bare msgpack unpack of the
same items as a map (the format before the typed messages, no checks), in the same process. Also
the cost of encoding it on the instance. Target: 64 items within 2x the bare unpack. And the
instance-side cost of one ``add`` (a request: 64 prompt tokens, sampling parameters, its SLO as
typed targets the decoder checks, not checked again when the request is built).

    python benchmarks/wire_codec.py      # writes benchmarks/results/wire_codec.{json,md}
"""

from __future__ import annotations

import json
import platform
import sys
import timeit
from pathlib import Path

import msgpack

from laneserve.cluster.messages import Add, RequestDesc, TokenItem, Tokens, WireSLO, decode, encode
from laneserve.core.sampling import SamplingParams

OUT = Path(__file__).resolve().parent / "results"
BATCHES = (1, 16, 64, 256)
REPEATS = 40


def per_call(fns: dict, number: int) -> dict:
    """Best of REPEATS timings of each function, seconds per call; the functions take turns, so
    that a burst of load on a shared machine falls on all of them alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(REPEATS):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number)
    return best


def add_row() -> dict:
    """One ``add``: typed decode (and building its request) against a bare unpack of the same bytes."""
    desc = RequestDesc(7, list(range(100, 164)), SamplingParams(max_tokens=64, temperature=0.7, seed=1), 1.5,
                       WireSLO(0.5, 0.05), "gold", 1)
    data = encode(Add(desc))
    t = per_call({"unpack": lambda: msgpack.unpackb(data, raw=False, strict_map_key=False),
                  "decode": lambda: decode(data, vocab_size=1000),
                  "request": lambda: decode(data, vocab_size=1000).request.request()}, 2000)
    return {"bare_unpack_us": t["unpack"] * 1e6, "decode_us": t["decode"] * 1e6,
            "decode_request_us": t["request"] * 1e6, "decode_over_bare": t["decode"] / t["unpack"]}


def main() -> int:
    rows = []
    for n in BATCHES:
        msg = Tokens(items=tuple(TokenItem(1000 + i, [17 + i]) for i in range(n)), inst=1, gen=0)
        data = encode(msg)
        bare = msgpack.packb({"k": "tok", "inst": 1, "gen": 0,
                              "items": [[1000 + i, [17 + i], None, None, None] for i in range(n)]})
        number = max(50, 5000 // n)
        t = per_call({"unpack": lambda bare=bare: msgpack.unpackb(bare, raw=False, strict_map_key=False),
                      "decode": lambda data=data: decode(data), "encode": lambda msg=msg: encode(msg)}, number)
        unpack, dec, enc = t["unpack"], t["decode"], t["encode"]
        rows.append({"items": n, "bare_unpack_us": unpack * 1e6, "decode_us": dec * 1e6,
                     "decode_per_item_us": dec * 1e6 / n, "encode_us": enc * 1e6,
                     "decode_over_bare": dec / unpack})
    add = add_row()
    OUT.mkdir(exist_ok=True)
    (OUT / "wire_codec.json").write_text(json.dumps({"tokens": rows, "add": add}, indent=1) + "\n")
    lines = ["# wire_codec", "", "Command: `python benchmarks/wire_codec.py`  ",
             f"Machine: {platform.machine()}, Python {platform.python_version()}, best of {REPEATS} interleaved timings", "",
             "| items | bare msgpack unpack (us) | typed decode (us) | per item (us) | encode (us) | decode / bare |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['items']} | {r['bare_unpack_us']:.1f} | {r['decode_us']:.1f} | {r['decode_per_item_us']:.2f} "
              f"| {r['encode_us']:.1f} | {r['decode_over_bare']:.1f}x |" for r in rows]
    lines += ["", "One `add` (64 prompt tokens, sampling parameters, SLO):", "",
              "| bare msgpack unpack (us) | typed decode (us) | decode + build the request (us) | decode / bare |",
              "|---|---|---|---|",
              f"| {add['bare_unpack_us']:.1f} | {add['decode_us']:.1f} | {add['decode_request_us']:.1f} "
              f"| {add['decode_over_bare']:.1f}x |"]
    (OUT / "wire_codec.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

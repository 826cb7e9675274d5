"""KV hand-off between tensor-parallel groups of any degrees (a TP_p prefill instance to a TP_d
decode instance: 4->4, 2->1, 1->2, 4->2, 3->1, ...).

Which KV heads a rank owns (:func:`kv_heads_of_rank`, the rule the sharded model uses too):
with ``tp <= num_kv_heads`` the heads are split evenly (``num_kv_heads % tp == 0``), rank ``r``
owning ``[r * n / tp, (r + 1) * n / tp)``; with ``tp > num_kv_heads`` each head is replicated on
``tp / n`` consecutive ranks (``tp % num_kv_heads == 0``), rank ``r`` owning head ``r * n // tp``
(vLLM's rule). Other pairs are refused with the numbers in the message.

The hand-off keeps one code path for every pair and every transport: the source ranks' exports
travel *as they are* (one :class:`~laneserve.engine.kv_cache.KVPayload` per source rank, its own
heads) inside one :class:`ShardedKVPayload`, which is what the cluster runtime's link takes from
the prefill instance and delivers to the decode instance (the destination is not known when the
KV leaves the source, so the source cannot cut it for the destination). Each destination rank
then asks the payload for its heads (:meth:`ShardedKVPayload.for_rank`): the plan
(:func:`reshard_plan`) names, per destination rank, which source rank's payload gives which of its
heads (replicated heads are read from one replica, chosen to spread the readers). A plain
``KVPayload`` is the TP1 case (:func:`as_sharded`).

Between processes and machines the payload crosses through any registered KV transport
(``laneserve.cluster.transport``: ``shm`` files, ``inline``, Ray's object store): :func:`put_sharded`
puts each shard with the transport and returns one msgpack-able descriptor (``"t": "sharded"``)
listing the shards' descriptors; :func:`get_sharded` gets them back (each shard exactly once, as the
transports' ``get`` consumes); :func:`discard_sharded` drops them all
(``transport.discard_descriptor`` knows the kind, so a router discards it without torch).
Where the destination's ranks are processes on the source's machine, each rank can instead read
just its own heads straight out of the shards' shared memory (:func:`read_for_rank`, ``shm`` and
``inline`` shards: nothing consumed), and one of them discards the descriptor once all imported.
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from laneserve.engine.kv_cache import KVPayload


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank ``rank`` of a TP-``tp`` group holds (module docstring)."""
    if num_kv_heads < 1 or tp < 1:
        raise ValueError(f"num_kv_heads and tp must be >= 1, got {num_kv_heads} and {tp}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside a TP-{tp} group")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split across {tp} ranks "
                             f"({num_kv_heads} is not a multiple of {tp})")
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated across {tp} ranks "
                         f"({tp} is not a multiple of {num_kv_heads})")
    head = rank * num_kv_heads // tp
    return range(head, head + 1)


@dataclass(frozen=True, slots=True)
class Piece:
    """Heads ``[src_start, src_start + count)`` of source rank ``src_rank``'s payload (local head
    indices) go to heads ``[dst_start, dst_start + count)`` of the destination rank's payload."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def reshard_plan(num_kv_heads: int, tp_src: int, tp_dst: int) -> list[list[Piece]]:
    """Per destination rank, the pieces of source payloads that make up its heads, in order;
    adjacent heads from one source rank are one piece."""
    src = [kv_heads_of_rank(num_kv_heads, tp_src, r) for r in range(tp_src)]
    owners: dict[int, list[int]] = {}
    for r, heads in enumerate(src):
        for h in heads:
            owners.setdefault(h, []).append(r)
    plan: list[list[Piece]] = []
    for d in range(tp_dst):
        pieces: list[Piece] = []
        for i, h in enumerate(kv_heads_of_rank(num_kv_heads, tp_dst, d)):
            replicas = owners[h]
            r = replicas[d % len(replicas)]            # spread the readers over the replicas
            local = h - src[r].start
            last = pieces[-1] if pieces else None
            if last and last.src_rank == r and last.src_start + last.count == local:
                pieces[-1] = Piece(r, last.src_start, last.dst_start, last.count + 1)
            else:
                pieces.append(Piece(r, local, i, 1))
        plan.append(pieces)
    return plan


@dataclass(slots=True)
class ShardedKVPayload:
    """A request's KV as the ranks of a TP-``len(shards)`` group hold it: ``shards[r].kv`` is
    ``[layers, 2, num_tokens, heads of rank r, head_dim]``."""

    num_kv_heads: int
    shards: list[KVPayload]

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("a sharded KV payload needs at least one shard")
        tokens = {s.num_tokens for s in self.shards}
        if len(tokens) != 1:
            raise ValueError(f"the shards disagree on the token count: {sorted(tokens)}")
        for r, s in enumerate(self.shards):
            want = len(kv_heads_of_rank(self.num_kv_heads, self.tp, r))
            if s.kv.dim() != 5 or s.kv.shape[3] != want:
                raise ValueError(f"shard {r} has KV of shape {tuple(s.kv.shape)}; rank {r} of TP-{self.tp} "
                                 f"holds {want} of {self.num_kv_heads} KV heads")

    @property
    def tp(self) -> int:
        return len(self.shards)

    @property
    def num_tokens(self) -> int:
        return self.shards[0].num_tokens

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def for_rank(self, tp_dst: int, rank: int) -> KVPayload:
        """The KV rank ``rank`` of a TP-``tp_dst`` group holds."""
        pieces = reshard_plan(self.num_kv_heads, self.tp, tp_dst)[rank]
        if len(pieces) == 1 and pieces[0].count == self.shards[pieces[0].src_rank].kv.shape[3]:
            return self.shards[pieces[0].src_rank]          # the whole shard: no copy
        parts = [self.shards[p.src_rank].kv[:, :, :, p.src_start:p.src_start + p.count] for p in pieces]
        return KVPayload(self.num_tokens, torch.cat(parts, dim=3))


def as_sharded(payload: KVPayload | ShardedKVPayload, num_kv_heads: int) -> ShardedKVPayload:
    """``payload`` as a sharded payload (a plain one is a TP1 group's)."""
    if isinstance(payload, ShardedKVPayload):
        if payload.num_kv_heads != num_kv_heads:
            raise ValueError(f"payload has {payload.num_kv_heads} KV heads, the model {num_kv_heads}")
        return payload
    return ShardedKVPayload(num_kv_heads, [payload])


def kv_for_rank(payload: KVPayload | ShardedKVPayload, num_kv_heads: int, tp_dst: int, rank: int) -> KVPayload:
    """What destination rank ``rank`` of a TP-``tp_dst`` instance imports from ``payload``."""
    return as_sharded(payload, num_kv_heads).for_rank(tp_dst, rank)


# ---- across processes: through a KV transport ---------------------------------------------------
def put_sharded(transport: Any, rid: int, payload: ShardedKVPayload) -> dict[str, Any]:
    """Put every shard with ``transport``; one descriptor for the whole group's KV."""
    descs: list[dict[str, Any]] = []
    try:
        for shard in payload.shards:
            descs.append(transport.put(rid, shard))
    except BaseException:
        for desc in descs:
            transport.discard(desc)
        raise
    return {"t": "sharded", "heads": payload.num_kv_heads, "n": payload.num_tokens, "shards": descs}


def get_sharded(transport: Any, desc: dict[str, Any]) -> ShardedKVPayload:
    """The payload of :func:`put_sharded`'s descriptor (every shard read once; a failure drops
    the shards not read yet)."""
    if desc.get("t") != "sharded":
        raise ValueError(f"not a sharded KV descriptor: {desc.get('t')!r}")
    shards: list[KVPayload] = []
    rest = list(desc["shards"])
    try:
        while rest:
            shards.append(transport.get(rest[0]))
            rest.pop(0)
    except BaseException:
        for d in rest:
            transport.discard(d)
        raise
    return ShardedKVPayload(int(desc["heads"]), shards)


def read_for_rank(desc: dict[str, Any], tp_dst: int, rank: int) -> KVPayload:
    """Destination rank ``rank``'s heads read directly from a sharded descriptor's ``shm`` (or
    ``inline``) shards: only the pieces it owns are copied, the shards stay for the other ranks
    (:func:`discard_sharded` them when every rank has read)."""
    if desc.get("t") != "sharded":
        raise ValueError(f"not a sharded KV descriptor: {desc.get('t')!r}")
    heads, shards = int(desc["heads"]), desc["shards"]
    pieces = reshard_plan(heads, len(shards), tp_dst)[rank]
    parts = [_read_heads(shards[p.src_rank], p.src_start, p.count) for p in pieces]
    return KVPayload(int(desc["n"]), torch.cat(parts, dim=3) if len(parts) > 1 else parts[0])


def _read_heads(desc: dict[str, Any], start: int, count: int) -> torch.Tensor:
    """Heads ``[start, start + count)`` of one shard, copied out of its shared memory (``shm``: a
    read-only mapping of its file) or its message bytes (``inline``)."""
    from laneserve.cluster.transport import _dtype, tensor_from_bytes
    kind = desc.get("t")
    if kind == "inline":
        return tensor_from_bytes(desc["data"], desc["dtype"], desc["shape"])[:, :, :, start:start + count].clone()
    if kind != "shm":
        raise ValueError(f"a {kind!r} shard is read once, by get_sharded")
    dtype, shape = _dtype(desc["dtype"]), tuple(desc["shape"])
    if not desc["bytes"]:
        return torch.empty(shape, dtype=dtype)[:, :, :, start:start + count]
    with open(desc["path"], "rb") as f, mmap.mmap(f.fileno(), desc["bytes"], prot=mmap.PROT_READ) as mm:
        with warnings.catch_warnings():          # a read-only buffer: the view is only read from
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mm, dtype=dtype, count=desc["bytes"] // dtype.itemsize)
        out = view.view(shape)[:, :, :, start:start + count].clone()
        del view                                  # the mapping's last export, before it closes
    return out


def discard_sharded(transport: Any, desc: dict[str, Any] | None) -> None:
    """Drop every shard of ``desc`` (its request was cancelled or nobody will read it)."""
    if desc:
        for d in desc.get("shards", ()):
            transport.discard(d)

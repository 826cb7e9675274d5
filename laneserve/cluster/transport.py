"""KV transports: how a prefilled request's KV (:class:`~laneserve.engine.kv_cache.KVPayload`)
travels from a prefill instance process to a decode instance process (shared host
memory on one machine; a pluggable transport for GPUs).

A transport turns a payload into a small msgpack-able *descriptor* on the sending side
(:meth:`put`) and back into a payload on the receiving side (:meth:`get`); :meth:`discard` drops a
descriptor whose request was cancelled or whose receiver died. Registered transports:

- ``shm``    a memory-mapped file in ``/dev/shm`` (tmpfs: host RAM, no disk). The sender copies
  the KV tensor into the mapping once; the receiver maps it, the engine copies it into its paged
  cache, and the file is unlinked. One copy on each side, nothing through the sockets.
- ``inline`` the tensor bytes inside the message itself (works across machines over TCP; a
  baseline and a fallback).
- ``ray``    across machines through Ray's object store (:mod:`laneserve.cluster.ray_kv`): the
  prefill side puts the KV into its node's store under a lease, the decode side claims and gets it
  (Ray moves the bytes node to node), each step with a timeout.

Every transport also says how many payloads it still :meth:`held` for a receiver (the ``kv_held``
gauge of an instance: 0 at rest). A GPU transport (CUDA IPC handles, NCCL send/recv, NIXL) would
register here under its own name with the same four methods: ``put`` returns a descriptor of GPU
memory, ``get`` pulls it into the decode side's blocks, ``discard`` frees it on the sender.
Tensor (de)serialisation uses ``torch.frombuffer``, so any dtype the engine runs (fp32, bf16,
fp16) passes through unchanged.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path
from typing import Any

_TRANSPORTS: dict[str, type] = {}
_OPTIONAL = {"ray": "laneserve.cluster.ray_kv"}     # registered on first use (needs the ``ray`` extra)


def register_transport(name: str):
    def deco(cls: type) -> type:
        _TRANSPORTS[name] = cls
        cls.name = name
        return cls
    return deco


def make_transport(name: str, **opts: Any):
    if name in _OPTIONAL and name not in _TRANSPORTS:
        import importlib
        importlib.import_module(_OPTIONAL[name])
    try:
        return _TRANSPORTS[name](**opts)
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; available: {', '.join(sorted(_TRANSPORTS))}") from None


def available_transports() -> list[str]:
    return sorted({*_TRANSPORTS, *_OPTIONAL})


def _dtype(name: str):
    import torch
    return getattr(torch, name)


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def default_shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


@register_transport("shm")
class ShmFileTransport:
    """KV through memory-mapped files under ``directory`` (one per request, unlinked on receipt)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory else default_shm_dir()
        self.directory.mkdir(parents=True, exist_ok=True)

    def put(self, rid: int, payload) -> dict[str, Any]:
        import torch
        kv = payload.kv.contiguous()
        nbytes = kv.numel() * kv.element_size()
        path = self.directory / f"kv-{rid}-{uuid.uuid4().hex[:8]}"
        with open(path, "w+b") as f:
            f.truncate(max(nbytes, 1))
            if nbytes:
                with mmap.mmap(f.fileno(), nbytes) as mm:
                    view = torch.frombuffer(mm, dtype=kv.dtype, count=kv.numel()).view(kv.shape)
                    view.copy_(kv)
                    del view
        return {"t": self.name, "path": str(path), "shape": list(kv.shape), "dtype": _dtype_name(kv),
                "n": payload.num_tokens, "bytes": nbytes}

    def get(self, desc: dict[str, Any]):
        """The payload of ``desc`` (a private copy; the file is unlinked)."""
        import torch

        from laneserve.engine.kv_cache import KVPayload
        path = Path(desc["path"])
        dtype = _dtype(desc["dtype"])
        shape = tuple(desc["shape"])
        try:
            with open(path, "r+b") as f:
                nbytes = desc["bytes"]
                if nbytes:
                    with mmap.mmap(f.fileno(), nbytes) as mm:
                        src = torch.frombuffer(mm, dtype=dtype, count=nbytes // torch.empty(0, dtype=dtype).element_size())
                        kv = src.view(shape).clone()
                        del src
                else:
                    kv = torch.empty(shape, dtype=dtype)
        finally:
            self.discard(desc)
        return KVPayload(int(desc["n"]), kv)

    def discard(self, desc: dict[str, Any] | None) -> None:
        if desc and desc.get("path"):
            try:
                os.unlink(desc["path"])
            except FileNotFoundError:
                pass

    def held(self) -> int:
        return 0                     # files are the router's to count (``kv_files``)


@register_transport("inline")
class InlineTransport:
    """KV bytes inside the message (no shared memory needed; one extra copy through the socket)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        pass

    def put(self, rid: int, payload) -> dict[str, Any]:
        kv = payload.kv
        return {"t": self.name, "data": tensor_to_bytes(kv).tobytes(), "shape": list(kv.shape),
                "dtype": _dtype_name(kv), "n": payload.num_tokens}

    def get(self, desc: dict[str, Any]):
        from laneserve.engine.kv_cache import KVPayload
        return KVPayload(int(desc["n"]), tensor_from_bytes(desc["data"], desc["dtype"], desc["shape"]))

    def discard(self, desc: dict[str, Any] | None) -> None:
        pass

    def held(self) -> int:
        return 0


def discard_descriptor(desc: dict[str, Any] | None) -> None:
    """Drop a descriptor without knowing its transport's options (router side, no torch)."""
    if desc and desc.get("t") == "shm" and desc.get("path"):
        try:
            os.unlink(desc["path"])
        except FileNotFoundError:
            pass
    elif desc and desc.get("t") == "ray":
        from laneserve.cluster.ray_kv import release
        release(desc)
    elif desc and desc.get("t") == "sharded":     # a tensor-parallel group's shards (engine/tp/kv_reshard.py)
        for shard in desc.get("shards", ()):
            discard_descriptor(shard)


def tensor_to_bytes(kv):
    """A contiguous tensor's bytes as a flat uint8 numpy array (any dtype, bf16 included)."""
    kv = kv.contiguous()
    return kv.view(-1).view(_dtype("uint8")).numpy() if kv.numel() else kv.new_empty(0, dtype=_dtype("uint8")).numpy()


def tensor_from_bytes(data, dtype: str, shape) -> Any:
    """The tensor of :func:`tensor_to_bytes`'s ``data`` (bytes-like, copied: the result is writable)."""
    import torch
    shape = tuple(shape)
    if not len(data):
        return torch.empty(shape, dtype=_dtype(dtype))
    return torch.frombuffer(bytearray(data), dtype=_dtype(dtype)).view(shape)

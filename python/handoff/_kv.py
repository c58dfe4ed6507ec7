"""KV caches as address ranges: what a `Runtime` registers.

A worker's KV memory is a list of *ranges*; block ``b`` of a range is ``bytes`` bytes at
``addr + b * stride``, and every range has the same number of blocks. A logical block is
the concatenation, in range order, of the block's bytes in every range (layer-major:
layer 0 K, layer 0 V, layer 1 K, ...).

Tensors are duck-typed (``.data_ptr()``, ``.stride()``, ``.element_size()``, ``.shape``,
``.device``), arrays read through ``__array_interface__``: neither torch nor numpy is
imported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._errors import InvalidInput, LayoutError


class KvRange(NamedTuple):
    """One registered range: block ``b`` is ``bytes`` bytes at ``addr + b * stride``."""

    addr: int
    stride: int
    bytes: int


@dataclass
class KvSpec:
    """Everything a `Runtime` registers: ranges (all of ``num_blocks`` blocks), where they
    live, and the objects that own the memory (kept alive while the runtime lives)."""

    ranges: list[KvRange]
    num_blocks: int
    device: str = "cpu"
    block_tokens: int = 0
    dtype_bytes: int = 0
    owners: list[Any] = field(default_factory=list)

    @property
    def block_bytes(self) -> int:
        """Bytes of one logical block."""
        return sum(r.bytes for r in self.ranges)


class _Described(NamedTuple):
    addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int
    device: str
    readonly: bool


def _int(name: str, v: Any, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInput(f"{name} must be an int, not {type(v).__name__}")
    if v < minimum:
        raise InvalidInput(f"{name} must be >= {minimum}, not {v}")
    return v


def _device_name(device: Any) -> str:
    kind = getattr(device, "type", None)
    if kind is None:
        text = str(device)
        return "cpu" if text == "cpu" else text
    if kind == "cpu":
        return "cpu"
    index = getattr(device, "index", None)
    return f"{kind}:{index if index is not None else 0}"


def _describe(obj: Any) -> _Described:
    """Address, shape, byte strides, item size and device of a tensor or an array."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "stride"):
        try:
            itemsize = int(obj.element_size())
            shape = tuple(int(d) for d in obj.shape)
            strides = tuple(int(s) * itemsize for s in obj.stride())
            addr = int(obj.data_ptr())
        except Exception as e:
            raise InvalidInput(f"cannot read {type(obj).__name__} as a tensor: {e}") from e
        device = _device_name(getattr(obj, "device", "cpu"))
        return _Described(addr, shape, strides, itemsize, device, False)
    iface = getattr(obj, "__array_interface__", None)
    if isinstance(iface, dict):
        try:
            addr, readonly = iface["data"]
            shape = tuple(int(d) for d in iface["shape"])
            typestr = str(iface["typestr"])
            itemsize = int(typestr[2:])
            strides = iface.get("strides")
        except Exception as e:
            raise InvalidInput(
                f"cannot read the array interface of {type(obj).__name__}: {e}"
            ) from e
        if strides is None:  # C-contiguous
            strides, step = [], itemsize
            for d in reversed(shape):
                strides.append(step)
                step *= max(d, 1)
            strides = tuple(reversed(strides))
        return _Described(int(addr), shape, tuple(strides), itemsize, "cpu", bool(readonly))
    raise InvalidInput(
        f"{type(obj).__name__} is neither a tensor (data_ptr, stride, element_size, shape, "
        "device) nor an array (__array_interface__), a KvRange or a (pointer, bytes, device) tuple"
    )


def _block_ranges(
    obj: Any, block_dim: int, what: str, tokens_per_row: int = 1
) -> tuple[list[KvRange], int, _Described]:
    """Ranges of a tensor whose blocks run along ``block_dim``: one range per index of the
    dimensions before it; the dimensions after it must be contiguous (one block is one
    piece of memory). ``tokens_per_row`` rows of the block dimension form one block (SGLang
    pages)."""
    d = _describe(obj)
    if len(d.shape) <= block_dim:
        raise LayoutError(f"{what}: shape {d.shape} has no dimension {block_dim} to hold blocks")
    if d.readonly:
        raise LayoutError(f"{what}: read-only memory cannot hold a KV cache")
    if any(s < 0 for s in d.strides):
        raise LayoutError(f"{what}: negative strides {d.strides}")
    if d.addr == 0 or math.prod(d.shape) == 0:
        raise LayoutError(f"{what}: empty (shape {d.shape})")
    expected = d.itemsize
    for dim in range(len(d.shape) - 1, block_dim, -1):
        if d.shape[dim] != 1 and d.strides[dim] != expected:
            raise LayoutError(
                f"{what}: not contiguous within a block (shape {d.shape}, byte strides "
                f"{d.strides}); dimension {dim} should have stride {expected}"
            )
        expected *= d.shape[dim]
    row_bytes = expected
    rows = d.shape[block_dim]
    if tokens_per_row > 1:
        if d.shape[block_dim] != 1 and d.strides[block_dim] != row_bytes:
            raise LayoutError(f"{what}: token rows are not contiguous (strides {d.strides})")
        blocks = rows // tokens_per_row
        stride, nbytes = row_bytes * tokens_per_row, row_bytes * tokens_per_row
    else:
        blocks, stride, nbytes = rows, d.strides[block_dim], row_bytes
    if blocks == 0:
        raise LayoutError(f"{what}: no whole block in shape {d.shape}")
    if blocks > 1 and stride < nbytes:
        raise LayoutError(f"{what}: blocks overlap (stride {stride} < {nbytes} bytes)")
    ranges = []
    for index in _indices(d.shape[:block_dim]):
        offset = sum(i * s for i, s in zip(index, d.strides))
        ranges.append(KvRange(d.addr + offset, stride, nbytes))
    return ranges, blocks, d


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [(*i, k) for i in out for k in range(n)]
    return out


def _check_same(specs: list[tuple[int, str]], what: str) -> tuple[int, str]:
    blocks = {b for b, _ in specs}
    devices = {dev for _, dev in specs}
    if len(blocks) != 1:
        raise LayoutError(f"{what}: every layer must hold the same number of blocks, not {blocks}")
    if len(devices) != 1:
        raise LayoutError(f"{what}: every layer must be on one device, not {devices}")
    return specs[0]


def _layers(kv_caches: Any) -> list[Any]:
    if isinstance(kv_caches, dict):
        return list(kv_caches.values())
    if isinstance(kv_caches, (list, tuple)):
        return list(kv_caches)
    raise InvalidInput(f"expected a list or dict of tensors, not {type(kv_caches).__name__}")


def vllm_kv_caches(kv_caches: Any, layout: str = "auto") -> KvSpec:
    """A `KvSpec` from vLLM's per-layer KV cache tensors (a list, or the dict given to
    ``register_kv_caches``, in layer order).

    ``layout``: ``"kv_first"`` for ``[2, num_blocks, block_size, heads, head_dim]`` (K and V
    halves: two ranges per layer), ``"blocks_first"`` for ``[num_blocks, 2, block_size, ...]``
    (interleaved: one range per layer), ``"mla"`` for ``[num_blocks, block_size, dim]`` (one
    range per layer), or ``"auto"`` to tell them apart by shape (ambiguous when
    ``num_blocks == 2``: then say which).
    """
    layers = _layers(kv_caches)
    if not layers:
        raise InvalidInput("no KV cache tensors given")
    if layout not in ("auto", "kv_first", "blocks_first", "mla"):
        raise InvalidInput(f"unknown layout {layout!r}")
    ranges: list[KvRange] = []
    seen: list[tuple[int, str]] = []
    tokens, itemsize = 0, 0
    for n, t in enumerate(layers):
        shape = tuple(_describe(t).shape)
        kind = layout
        if kind == "auto":
            if len(shape) == 3:
                kind = "mla"
            elif len(shape) >= 3 and shape[0] == 2 and shape[1] != 2:
                kind = "kv_first"
            elif len(shape) >= 3 and shape[1] == 2 and shape[0] != 2:
                kind = "blocks_first"
            else:
                raise LayoutError(
                    f"layer {n}: cannot tell the layout of shape {shape}; pass layout="
                    "'kv_first' or 'blocks_first'"
                )
        block_dim = 1 if kind == "kv_first" else 0
        got, blocks, d = _block_ranges(t, block_dim, f"layer {n} ({kind})")
        ranges += got
        seen.append((blocks, d.device))
        tokens = shape[2] if kind in ("kv_first", "blocks_first") else shape[1]
        itemsize = d.itemsize
    num_blocks, device = _check_same(seen, "vLLM KV caches")
    return KvSpec(ranges, num_blocks, device, tokens, itemsize, layers)


def sglang_kv_caches(k_buffers: Any, v_buffers: Any, page_size: int = 1) -> KvSpec:
    """A `KvSpec` from SGLang's per-layer K and V buffers (``[tokens, heads, head_dim]``
    each): two ranges per layer (K then V), a block being a page of ``page_size`` tokens."""
    page_size = _int("page_size", page_size, 1)
    ks, vs = _layers(k_buffers), _layers(v_buffers)
    if len(ks) != len(vs) or not ks:
        raise InvalidInput(
            f"{len(ks)} K buffers and {len(vs)} V buffers: need one of each per layer"
        )
    ranges: list[KvRange] = []
    seen: list[tuple[int, str]] = []
    itemsize = 0
    for n, (k, v) in enumerate(zip(ks, vs)):
        for name, t in (("K", k), ("V", v)):
            got, blocks, d = _block_ranges(t, 0, f"layer {n} {name}", tokens_per_row=page_size)
            ranges += got
            seen.append((blocks, d.device))
            itemsize = d.itemsize
    num_blocks, device = _check_same(seen, "SGLang KV buffers")
    return KvSpec(ranges, num_blocks, device, page_size, itemsize, ks + vs)


def kv_spec(kv_caches: Any, num_blocks: int | None = None, device: str | None = None) -> KvSpec:
    """What `Runtime` accepts as ``kv_caches``: a `KvSpec` (from `vllm_kv_caches` or
    `sglang_kv_caches`); or a list (or dict) of tensors or arrays with blocks along
    dimension 0 (one range each); of `KvRange`; of ``(addr, stride, bytes)``; or of
    ``(pointer, bytes, device)`` (a buffer of ``num_blocks`` equal blocks)."""
    if isinstance(kv_caches, KvSpec):
        spec = kv_caches
    else:
        spec = _spec_of_items(_layers(kv_caches), num_blocks, device)
    if num_blocks is not None and _int("num_blocks", num_blocks, 1) != spec.num_blocks:
        raise LayoutError(f"num_blocks={num_blocks}, but the KV caches hold {spec.num_blocks}")
    if device is not None and device != spec.device:
        raise LayoutError(f"device={device!r}, but the KV caches are on {spec.device!r}")
    if not spec.ranges:
        raise InvalidInput("no KV cache ranges given")
    return spec


def _spec_of_items(items: list[Any], num_blocks: int | None, device: str | None) -> KvSpec:
    ranges: list[KvRange] = []
    seen: list[tuple[int, str]] = []
    owners: list[Any] = []
    itemsize = 0
    for n, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 3 and isinstance(item[2], str):
            addr, nbytes, dev = _int("pointer", item[0], 1), _int("bytes", item[1], 1), item[2]
            if num_blocks is None:
                raise InvalidInput("a (pointer, bytes, device) tuple needs num_blocks")
            blocks = _int("num_blocks", num_blocks, 1)
            if nbytes % blocks:
                raise LayoutError(f"range {n}: {nbytes} bytes do not split into {blocks} blocks")
            ranges.append(KvRange(addr, nbytes // blocks, nbytes // blocks))
            seen.append((blocks, dev))
        elif isinstance(item, tuple) and len(item) == 3:  # KvRange or (addr, stride, bytes)
            r = KvRange(
                _int("addr", item[0], 1), _int("stride", item[1], 1), _int("bytes", item[2], 1)
            )
            if num_blocks is None:
                raise InvalidInput("KvRange items need num_blocks")
            ranges.append(r)
            seen.append((_int("num_blocks", num_blocks, 1), device or "cpu"))
        else:
            got, blocks, d = _block_ranges(item, 0, f"KV cache {n}")
            ranges += got
            seen.append((blocks, d.device))
            owners.append(item)
            itemsize = d.itemsize
    if not seen:
        raise InvalidInput("no KV caches given")
    blocks, dev = _check_same(seen, "KV caches")
    return KvSpec(ranges, blocks, dev, 0, itemsize, owners)


class HeadLayout(NamedTuple):
    """How every K or V part of a block holds a rank's KV heads (what `Runtime` takes as
    ``head_size`` and ``head_order``)."""

    #: ``"hnd"`` (each head's tokens together) or ``"nhd"`` (each token's heads together).
    order: str
    #: Elements of one head for one token (for vLLM's CPU layout, K and V together).
    head_size: int


def vllm_head_layout(
    tensors: list[Any], num_blocks: int, heads: int, block_tokens: int
) -> HeadLayout | str:
    """How vLLM's per-layer KV cache tensors hold this rank's ``heads`` KV heads in blocks
    of ``block_tokens`` tokens, read from their shapes and strides; or why it cannot be
    told (a string).

    Inside one block of one range (after K/V halves are split off), the dimension of size
    ``heads`` and the one of size ``block_tokens`` are found; the one with the larger
    stride is outer (``hnd`` when it is the heads'), everything inside both is one head's
    bytes for one token, and anything outside both is K and V parts of that range. The
    CPU backend's ``[num_blocks, heads, block_tokens, 2 * head_size]`` is ``hnd`` with
    each head's K and V rows inside its run (heads move whole either way); FlashAttention's
    ``[2, num_blocks, block_tokens, heads, head_size]`` is ``nhd`` unless vLLM was asked
    for a head-major layout (``get_required_kvcache_layout``).
    """
    seen: set[HeadLayout] = set()
    for t in tensors:
        d = _describe(t)
        shape, strides = d.shape, d.strides
        split_kv = len(shape) >= 4 and shape[0] == 2 and shape[1] % num_blocks == 0
        dims = list(zip(shape, strides))[2 if split_kv else 1 :]
        if (shape[1] if split_kv else shape[0]) != num_blocks:
            return f"kernel blocks smaller than vLLM's blocks (shape {shape})"
        # The innermost dimension is a head's content (its elements), never heads or tokens.
        content = min(range(len(dims)), key=lambda i: dims[i][1], default=None)
        head_dims = [i for i, (n, _) in enumerate(dims) if n == heads and i != content]
        token_dims = [i for i, (n, _) in enumerate(dims) if n == block_tokens and i != content]
        pairs = [(h, k) for h in head_dims for k in token_dims if h != k]
        if heads == block_tokens or len(pairs) != 1:
            return (
                f"cannot tell {heads} heads from {block_tokens} tokens in a block of shape {shape}"
            )
        h, k = pairs[0]
        # One head: its dimension's stride says nothing (torch keeps any stride for size 1),
        # and both orders are the same bytes.
        lo = dims[k][1] if heads == 1 else min(dims[h][1], dims[k][1])
        inner = [n for i, (n, st) in enumerate(dims) if i not in (h, k) and st < lo]
        order = "hnd" if heads == 1 or dims[h][1] > dims[k][1] else "nhd"
        seen.add(HeadLayout(order, math.prod(inner) if inner else 1))
    if len(seen) != 1:
        return f"layers hold their heads differently: {sorted(seen)}"
    return seen.pop()

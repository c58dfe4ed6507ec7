"""KV caches as address ranges: numpy arrays, duck-typed tensors, engine layouts."""

from __future__ import annotations

import handoff
import numpy as np
import pytest


class FakeTensor:
    """What `handoff` reads from a torch tensor, without torch."""

    def __init__(self, array: np.ndarray, device: str = "cuda", index: int | None = 1) -> None:
        self.array = array
        self.shape = array.shape
        self.device = type("Device", (), {"type": device, "index": index})()

    def data_ptr(self) -> int:
        return self.array.__array_interface__["data"][0]

    def element_size(self) -> int:
        return self.array.itemsize

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_numpy_array_is_one_range_of_its_rows():
    kv = np.zeros((10, 4, 8), np.float16)
    spec = handoff.kv_spec([kv])
    assert spec.ranges == [handoff.KvRange(addr(kv), 64, 64)]
    assert (spec.num_blocks, spec.device, spec.dtype_bytes, spec.block_bytes) == (10, "cpu", 2, 64)


def test_vllm_kv_first_layers_are_two_ranges_each():
    layers = [np.zeros((2, 6, 16, 2, 8), np.float16) for _ in range(3)]
    spec = handoff.vllm_kv_caches({f"layer.{i}": t for i, t in enumerate(layers)})
    block = 16 * 2 * 8 * 2
    want = []
    for t in layers:
        want += [
            handoff.KvRange(addr(t), block, block),
            handoff.KvRange(addr(t) + 6 * block, block, block),
        ]
    assert spec.ranges == want
    assert (spec.num_blocks, spec.block_tokens, spec.dtype_bytes) == (6, 16, 2)
    assert spec.block_bytes == 3 * 2 * block


def test_vllm_blocks_first_layers_are_one_range_each():
    layers = [np.zeros((6, 2, 16, 2, 8), np.float16) for _ in range(2)]
    spec = handoff.vllm_kv_caches(layers)
    block = 2 * 16 * 2 * 8 * 2
    assert spec.ranges == [handoff.KvRange(addr(t), block, block) for t in layers]


def test_mla_layers_are_one_range_each():
    layers = [np.zeros((6, 16, 64), np.float16)]
    spec = handoff.vllm_kv_caches(layers)
    assert spec.ranges == [handoff.KvRange(addr(layers[0]), 2048, 2048)]
    assert spec.block_tokens == 16


def test_a_padded_block_stride_is_kept():
    base = np.zeros((2, 6, 40), np.uint8)
    view = base[:, :, :32]  # blocks of 32 bytes, 40 apart: contiguous within a block
    spec = handoff.vllm_kv_caches([view], layout="kv_first")
    assert spec.ranges == [
        handoff.KvRange(addr(base), 40, 32),
        handoff.KvRange(addr(base) + 240, 40, 32),
    ]


def test_an_ambiguous_shape_must_be_named():
    with pytest.raises(handoff.LayoutError):
        handoff.vllm_kv_caches([np.zeros((2, 2, 16, 2, 8), np.float16)])
    spec = handoff.vllm_kv_caches([np.zeros((2, 2, 16, 2, 8), np.float16)], layout="kv_first")
    assert len(spec.ranges) == 2


def test_layers_must_agree():
    with pytest.raises(handoff.LayoutError):
        handoff.vllm_kv_caches(
            [np.zeros((2, 6, 4), np.uint8), np.zeros((2, 7, 4), np.uint8)], layout="kv_first"
        )
    with pytest.raises(handoff.LayoutError):
        handoff.vllm_kv_caches([np.zeros((2, 6, 4, 4), np.uint8)[:, :, :, ::2]])


def test_sglang_k_and_v_buffers_are_two_ranges_per_layer():
    ks = [np.zeros((64, 2, 8), np.float16) for _ in range(2)]
    vs = [np.zeros((64, 2, 8), np.float16) for _ in range(2)]
    spec = handoff.sglang_kv_caches(ks, vs, page_size=16)
    page = 16 * 2 * 8 * 2
    assert spec.num_blocks == 4 and spec.block_tokens == 16
    assert spec.ranges == [
        handoff.KvRange(addr(ks[0]), page, page),
        handoff.KvRange(addr(vs[0]), page, page),
        handoff.KvRange(addr(ks[1]), page, page),
        handoff.KvRange(addr(vs[1]), page, page),
    ]


def test_duck_typed_tensors_are_read_without_torch():
    t = FakeTensor(np.zeros((2, 6, 16, 2, 8), np.float16))
    spec = handoff.vllm_kv_caches([t])
    assert spec.device == "cuda:1" and len(spec.ranges) == 2
    assert spec.ranges[1].addr - spec.ranges[0].addr == 6 * 512
    cpu = FakeTensor(np.zeros((4, 8), np.float32), device="cpu", index=None)
    assert handoff.kv_spec([cpu]).device == "cpu"


def test_pointer_tuples_split_into_blocks():
    spec = handoff.kv_spec([(0x10000, 4096, "cpu")], num_blocks=8)
    assert spec.ranges == [handoff.KvRange(0x10000, 512, 512)]
    with pytest.raises(handoff.LayoutError):
        handoff.kv_spec([(0x10000, 4097, "cpu")], num_blocks=8)
    with pytest.raises(handoff.InvalidInput):
        handoff.kv_spec([(0x10000, 4096, "cpu")])


def test_per_layer_ranges_register_or_say_why(bootstrap):
    """Several ranges per block are one region (`Region::from_layout`), which the TCP data
    plane registers as it is."""
    layers = [np.zeros((2, 8, 64), np.uint8) for _ in range(2)]
    spec = handoff.vllm_kv_caches(layers, layout="kv_first")
    rt = handoff.Runtime("prefill", "P", bootstrap.address, spec, transport="tcp")
    with rt:
        assert rt.block_bytes == spec.block_bytes == 4 * 64


def test_vllm_head_layout_reads_the_head_order_from_shapes_and_strides():
    from handoff._kv import HeadLayout, vllm_head_layout

    nb, heads, tokens, hs = 5, 2, 16, 8
    # vLLM's CPU backend: [num_blocks, heads, block_size, 2 * head_size], head-major with
    # each head's K and V rows inside its run.
    cpu = [np.zeros((nb, heads, tokens, 2 * hs), np.float16) for _ in range(3)]
    assert vllm_head_layout(cpu, nb, heads, tokens) == HeadLayout("hnd", 2 * hs)
    # FlashAttention: [2, num_blocks, block_size, heads, head_size], token-major ...
    flash = [np.zeros((2, nb, tokens, heads, hs), np.float16)]
    assert vllm_head_layout(flash, nb, heads, tokens) == HeadLayout("nhd", hs)
    # ... or head-major when vLLM allocates LBHNC and hands out an NHD-shaped view.
    hnd = np.zeros((2, nb, heads, tokens, hs), np.float16).transpose(0, 1, 3, 2, 4)
    assert vllm_head_layout([hnd], nb, heads, tokens) == HeadLayout("hnd", hs)
    # One head per rank (TP equal to the KV heads): either order is the same bytes.
    one = [np.zeros((nb, 1, tokens, 2 * hs), np.float16)]
    assert vllm_head_layout(one, nb, 1, tokens) == HeadLayout("hnd", 2 * hs)
    # A head's content as long as the block's tokens (head size 64, blocks of 128) is
    # still told apart: it is the innermost dimension.
    square = [np.zeros((nb, heads, 2 * hs, 2 * hs), np.float16)]
    assert vllm_head_layout(square, nb, heads, 2 * hs) == HeadLayout("hnd", 2 * hs)
    # What cannot be told is said, not guessed.
    assert "cannot tell" in vllm_head_layout(cpu, nb, tokens, tokens)
    assert "cannot tell" in vllm_head_layout(cpu, nb, 3, tokens)
    mixed = [cpu[0], flash[0]]
    assert "differently" in vllm_head_layout(mixed, nb, heads, tokens)
    assert "kernel blocks" in vllm_head_layout([np.zeros((2 * nb, heads, 8, hs))], nb, heads, 8)

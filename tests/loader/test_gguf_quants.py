"""GGUF tensor reading and dequantisation for every type turnout promises (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K), read through gguf.GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
quantize = pytest.importorskip("gguf.quants").quantize
Q, GGUFWriter = gguf.GGMLQuantizationType, gguf.GGUFWriter

from turnout.loader.gguf import dequantize, read_tensors

# type -> max abs error allowed for N(0, 1) data
QUANTISABLE = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 3e-2, Q.Q4_0: 0.5, Q.Q4_1: 0.4}


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def _k_blocks(kind, rows: int) -> tuple[np.ndarray, float]:
    """Hand-built K-quant super-blocks (256 values) whose every value is known; gguf cannot quantise
    these types, so the bytes are laid out here. Returns (bytes [rows, row bytes], the value)."""
    if kind == Q.Q4_K:  # d, dmin, 12 scale bytes (6-bit sc/m pairs), 128 nibble bytes
        scales = bytes([1] * 4 + [1] * 4 + [0x11] * 4)  # sc = 1, m = 1 for all 8 sub-blocks
        block = _f16(0.5) + _f16(0.25) + scales + bytes([0x77] * 128)
        value = 0.5 * 7 - 0.25 * 1
    elif kind == Q.Q5_K:  # d, dmin, scales[12], qh[32], qs[128]
        scales = bytes([2] * 4 + [0] * 4 + [0x02] * 4)  # sc = 2, m = 0
        block = _f16(0.25) + _f16(0.0) + scales + bytes([0xFF] * 32) + bytes([0x33] * 128)
        value = 0.25 * 2 * (3 + 16)
    elif kind == Q.Q6_K:  # ql[128], qh[64], int8 scales[16], d
        block = bytes([0x55] * 128) + bytes([0xAA] * 64) + bytes([3] * 16) + _f16(0.5)
        value = 0.5 * 3 * ((5 | (2 << 4)) - 32)
    else:
        raise AssertionError(kind)
    data = np.frombuffer(block * (rows * 2), dtype=np.uint8).reshape(rows, -1)  # 2 blocks a row: 512 cols
    return data, value


def _write(path, tensors: dict[str, tuple[np.ndarray, Q, tuple[int, int]]]) -> None:
    w = GGUFWriter(str(path), "llama")
    for name, (data, qtype, _) in tensors.items():
        w.add_tensor(name, data, raw_shape=None if qtype in (Q.F32, Q.F16) else data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    original = rng.standard_normal((8, 512)).astype(np.float32)
    tensors, expect = {}, {}
    for qtype, tol in QUANTISABLE.items():
        tensors[f"t.{qtype.name}"] = (quantize(original, qtype), qtype, original.shape)
        expect[f"t.{qtype.name}"] = (original, tol)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data, value = _k_blocks(qtype, 3)
        tensors[f"t.{qtype.name}"] = (data, qtype, (3, 512))
        expect[f"t.{qtype.name}"] = (np.full((3, 512), value, dtype=np.float32), 0.0)
    path = tmp_path_factory.mktemp("gguf") / "quants.gguf"
    _write(path, tensors)
    return path, expect


def test_every_type_dequantises(gguf_file):
    path, expect = gguf_file
    arch, tensors = read_tensors(path)
    assert arch == "llama"
    seen = {}
    for name, ggml_type, data in tensors:
        seen[name] = dequantize(data, ggml_type)
        assert Q(ggml_type).name == name.split(".", 1)[1]
    assert set(seen) == set(expect)
    for name, (ref, tol) in expect.items():
        got = seen[name].numpy()
        assert got.dtype == np.float32 and got.shape == ref.shape, name
        assert np.abs(got - ref).max() <= tol + 1e-7, (name, np.abs(got - ref).max())

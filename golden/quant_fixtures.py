"""Quant fixtures: random blocks of every supported ggml type and gguf-py's dequantization.

Usage: python golden/quant_fixtures.py OUT_DIR

For each type this writes OUT_DIR/{TYPE}.safetensors with two tensors:
  blocks  U8  [n_bytes]     64 blocks of random bytes (F32/F16/BF16: 4096 random values)
  values  F32 [n_elements]  gguf.quants.dequantize(blocks), the reference the engine must match
                            bit for bit

Random bytes alone would put NaN, Inf and absurd magnitudes in the f16 scale fields, so every
scale field is overwritten with a finite value of the size real quantizers write (1e-5..1e-1),
with a few zero, negative and f16-subnormal scales mixed in. The quant bits stay random, which
exercises every code point. The output is deterministic: same seed, same bytes.

Run only by `cargo xtask golden`, which hashes the outputs into golden/manifest.json.
"""

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors.numpy import save_file

SEED = 20261201
N_BLOCKS = 64
N_FLOATS = 4096

# Byte offsets of the f16 scale fields inside one block (d, and dmin/m where the format has one).
SCALE_OFFSETS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}
FLOAT_TYPES = [T.F32, T.F16, T.BF16]


def realistic(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """n float64 values with log-uniform magnitude in [lo, hi), random sign, a few exact zeros."""
    mag = 10.0 ** rng.uniform(np.log10(lo), np.log10(hi), n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    x = mag * sign
    x[rng.choice(n, size=max(1, n // 32), replace=False)] = 0.0
    return x


def float_blocks(rng: np.random.Generator, t: T) -> np.ndarray:
    # Weights and norms: magnitudes 1e-6..10 (f16 subnormals start below 6.1e-5).
    x = realistic(rng, N_FLOATS, 1e-6, 10.0)
    if t == T.F32:
        return x.astype("<f4").view(np.uint8)
    if t == T.F16:
        return x.astype("<f2").view(np.uint8)
    # BF16: the top half of the f32 bits (truncation; any bf16 bit pattern is a valid input).
    bits = x.astype("<f4").view("<u4") >> np.uint32(16)
    return bits.astype("<u2").view(np.uint8)


def quant_blocks(rng: np.random.Generator, t: T) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, size=(N_BLOCKS, type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS[t]:
        scale = realistic(rng, N_BLOCKS, 1e-5, 1e-1).astype("<f2")
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(N_BLOCKS, 2)
    return blocks.reshape(-1)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for t in FLOAT_TYPES + sorted(SCALE_OFFSETS, key=lambda t: t.name):
        # One generator per type, so adding a type never changes another type's fixture.
        rng = np.random.default_rng([SEED, int(t)])
        blocks = float_blocks(rng, t) if t in FLOAT_TYPES else quant_blocks(rng, t)
        values = dequantize(blocks, t)
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        assert np.isfinite(values).all(), t.name
        save_file({"blocks": np.ascontiguousarray(blocks), "values": values}, str(out / f"{t.name}.safetensors"))


if __name__ == "__main__":
    main()

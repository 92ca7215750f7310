#!/usr/bin/env python3
"""Writes a gpt-oss checkpoint folder whose expert weights are stored in MXFP4, as the published
openai/gpt-oss-* checkpoints store them, and the fp32 values a correct loader must produce.

Usage: mxfp4_checkpoint.py MANIFEST OUT_DIR SHARDS EXPECTED [--trainable]
  MANIFEST  JSON list of {"name", "shape", "mxfp4"} (the model's tensors, from the C++ test)
  OUT_DIR   receives model.safetensors (SHARDS = 1) or SHARDS files model-0000i-of-0000n.safetensors
            and model.safetensors.index.json
  EXPECTED  receives one F32 safetensors file with every model tensor's expected fp32 values

--trainable writes values of a trained model's size instead of the format's edge cases (expert
scales 2^-7 .. 2^-3, other tensors 0.05 x N(0, 1), norms 1 + 0.05 x N(0, 1)), so that a forward pass
stays finite: for comparing logits with transformers (tests/transformers).

A tensor with "mxfp4": true, of model shape [E, A, B], is written as NAME_blocks [E, B, A/32, 16]
U8 and NAME_scales [E, B, A/32] U8 (the layout of transformers' Mxfp4GptOssExperts and of
convert_moe_packed_tensors in transformers/integrations/mxfp4.py). Every other tensor is BF16.

The dequantiser here is written independently of the C++ one: it decodes each E2M1 code from its
bits (sign, 2-bit exponent with bias 1, 1-bit mantissa, exponent 0 subnormal) instead of a table,
scales with numpy.ldexp in float64 and rounds to float32 (exact: every value is m * 2^k, m in
{0.5, 1, 1.5, 2, 3, 4, 6}), and lays the codes out with numpy reshapes and a transpose.
Safetensors files are written by hand here (the format: 8-byte little-endian header length, a
JSON header, the data), so the C++ writer is not involved either.
"""
import json
import os
import struct
import sys

import numpy as np


def e2m1_value(code):
    """The value of a 4-bit E2M1 code (OCP MX spec): s eem, bias 1, e = 0 subnormal (m * 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    e = (code >> 1) & 0b11
    m = code & 0b1
    mag = m * 0.5 if e == 0 else (1.0 + 0.5 * m) * 2.0 ** (e - 1)
    return sign * mag


def dequantize(blocks, scales):
    """blocks [E, B, G, 16] uint8, scales [E, B, G] uint8 -> [E, G*32, B] float32."""
    codes = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F  # the low nibble is the even element
    codes[..., 1::2] = blocks >> 4
    table = np.array([e2m1_value(c) for c in range(16)], dtype=np.float64)
    vals = table[codes]
    vals = np.ldexp(vals, scales.astype(np.int64)[..., None] - 127)
    e, b, g, _ = vals.shape
    vals = vals.reshape(e, b, g * 32).astype(np.float32)
    return np.ascontiguousarray(vals.transpose(0, 2, 1))


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype string, shape, bytes)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)


def main():
    manifest, out_dir, shards, expected_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    trainable = "--trainable" in sys.argv[5:]
    with open(manifest) as f:
        model = json.load(f)
    rng = np.random.default_rng(20261204)
    stored, expected = [], []
    stats = {"mxfp4_values": 0, "negative_zero": 0, "subnormal": 0, "scale_254": 0, "scale_0": 0}
    for t in model:
        name, shape = t["name"], tuple(t["shape"])
        if t["mxfp4"]:
            e, a, b = shape
            g = a // 32
            blocks = rng.integers(0, 256, size=(e, b, g, 16), dtype=np.uint8)
            scales = rng.integers(112, 143, size=(e, b, g), dtype=np.uint8)
            if trainable:
                scales = rng.integers(120, 125, size=(e, b, g), dtype=np.uint8)
            else:
                # The ends of the E8M0 range: 0 and 1 give fp32 subnormals (0.5 * 2^-127 = 2^-128), 254
                # the largest finite scale, whose blocks keep |code value| <= 1.5 so nothing overflows.
                scales[0, 0, 0] = 0
                scales[0, 1 % b, 0] = 1
                scales[e - 1, b - 1, g - 1] = 254
                blocks[e - 1, b - 1, g - 1] &= 0x33  # codes 0..3: 0, 0.5, 1, 1.5 (positive)
                scales[e - 1, 0, 0] = 254
                blocks[e - 1, 0, 0] = (blocks[e - 1, 0, 0] & 0x33) | 0x88  # codes 8..11: -0, -0.5, -1, -1.5
            stats["scale_0"] += int((scales == 0).sum())
            stats["scale_254"] += int((scales == 254).sum())
            values = dequantize(blocks, scales)
            assert values.shape == shape, (name, values.shape, shape)
            assert np.isfinite(values).all()
            stats["mxfp4_values"] += values.size
            stats["negative_zero"] += int(((values == 0) & np.signbit(values)).sum())
            stats["subnormal"] += int(((values != 0) & (np.abs(values) < np.finfo(np.float32).tiny)).sum())
            stored.append((name + "_blocks", "U8", blocks.shape, blocks.tobytes()))
            stored.append((name + "_scales", "U8", scales.shape, scales.tobytes()))
            expected.append((name, "F32", shape, values.astype("<f4").tobytes()))
        else:
            f32 = rng.standard_normal(size=shape).astype(np.float32)
            if trainable:
                f32 = (1.0 + 0.05 * f32 if "norm" in name else 0.05 * f32).astype(np.float32)
            bits = (f32.view(np.uint32) >> 16).astype("<u2")  # bf16 by truncation: the value is known exactly
            stored.append((name, "BF16", shape, bits.tobytes()))
            widened = (bits.astype(np.uint32) << 16).view(np.float32)
            expected.append((name, "F32", shape, widened.astype("<f4").tobytes()))
    os.makedirs(out_dir, exist_ok=True)
    if shards == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), stored)
    else:
        # Round-robin over the shards, so that a tensor's _blocks and _scales land in different files.
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        parts = [[] for _ in range(shards)]
        weight_map = {}
        for i, t in enumerate(stored):
            parts[i % shards].append(t)
            weight_map[t[0]] = files[i % shards]
        for fname, part in zip(files, parts):
            write_safetensors(os.path.join(out_dir, fname), part)
        total = sum(len(t[3]) for t in stored)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    write_safetensors(expected_path, expected)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()

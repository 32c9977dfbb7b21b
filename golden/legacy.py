"""Rewrites a split-MLA deepseek2 GGUF into the legacy layout (one `attn_kv_b` per layer).

    python golden/legacy.py IN.gguf OUT.gguf

Files converted before llama.cpp split the MLA decompression (2025) carry `attn_kv_b`
{kv_lora, H*(nope+v)} with per-head rows [k_nope | v], report the per-head MHA sizes as
key_length / value_length, head_count_kv = head_count, and have no *_mla keys. Engines must
still load them; this makes one from the current converter's output without touching any value.
"""

import sys

import gguf
import numpy as np


def main() -> None:
    src, dst = sys.argv[1:]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.") and k != "general.architecture"}

    def get(key):
        return fields[f"{arch}.{key}"].contents()

    rope, heads = get("rope.dimension_count"), get("attention.head_count")
    legacy_keys = {
        f"{arch}.attention.key_length": get("attention.key_length_mla"),  # nope + rope
        f"{arch}.attention.value_length": get("attention.value_length_mla"),
        f"{arch}.attention.head_count_kv": heads,
    }
    dropped = {f"{arch}.attention.key_length_mla", f"{arch}.attention.value_length_mla"}

    writer = gguf.GGUFWriter(dst, arch)
    for key, field in fields.items():
        if key in dropped:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = legacy_keys.get(key, field.contents())
        writer.add_key_value(key, value, vtype, sub_type=sub)

    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise SystemExit(f"legacy.py: {src}: {t.name} is {t.tensor_type.name}, expected F32")
        shape = tuple(int(n) for n in reversed(t.shape))
        data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        if t.name.endswith("attn_v_b.weight"):
            continue
        if t.name.endswith("attn_k_b.weight"):
            # attn_k_b [H, kv_lora, nope] (W_UK transposed), attn_v_b [H, v, kv_lora]
            v_b = tensors[t.name.replace("attn_k_b", "attn_v_b")]
            v = np.asarray(v_b.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(v_b.shape)))
            kv_b = np.concatenate([np.transpose(data, (0, 2, 1)), v], axis=1)
            writer.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), kv_b.reshape(-1, kv_b.shape[-1]).copy())
        else:
            writer.add_tensor(t.name, data.copy())

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()

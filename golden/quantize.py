"""llama.cpp's own quantizer (`llama_model_quantize`, through llama-cpp-python) on one file.

    python golden/quantize.py ftype IN.gguf OUT.gguf FTYPE          # e.g. Q4_K_M, Q8_0
    python golden/quantize.py mix   IN.gguf OUT.gguf REGEX=TYPE ... # Q8_0 base, per-tensor types

Rows that are not a multiple of 256 fall back to a 32-element type inside llama.cpp (Q4_K ->
Q5_0, ...); manifest.py records which types actually landed.
"""

import ctypes
import sys

import gguf
import llama_cpp


@llama_cpp.llama_log_callback
def warnings_only(level, text, user_data):
    """llama.cpp logs every tensor at INFO level; keep warnings and errors."""
    if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def main() -> None:
    llama_cpp.llama_log_set(warnings_only, None)
    mode, src, dst, *rest = sys.argv[1:]
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 1
    keep_alive = []
    if mode == "ftype":
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{rest[0]}")
    elif mode == "mix":
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        overrides = (llama_cpp.llama_model_tensor_override * (len(rest) + 1))()
        for i, spec in enumerate(rest):
            pattern, qtype = spec.rsplit("=", 1)
            keep_alive.append(pattern.encode())
            overrides[i].pattern = keep_alive[-1]
            overrides[i].type = gguf.GGMLQuantizationType[qtype.upper()].value
        overrides[len(rest)].pattern = None  # terminator
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    else:
        raise SystemExit(f"quantize.py: unknown mode {mode!r}")
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"quantize.py: llama_model_quantize({src} -> {dst}) returned {rc}")


if __name__ == "__main__":
    main()

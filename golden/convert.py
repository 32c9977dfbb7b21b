"""Runs llama.cpp's `convert_hf_to_gguf.py` on a tiny checkpoint, with the pre-tokenizer named.

`python golden/convert.py CONVERTER_DIR PRE HF_DIR OUT.gguf [converter args...]`

The converter identifies a BPE pre-tokenizer by hashing the ids the tokenizer gives a fixed
text, so a tokenizer trained here is never recognized. PRE (`deepseek-v3`, `glm4`) is the name
the real family's tokenizer hashes to; we answer it for the converter's lookup and let the rest
of the converter run unchanged.
"""

import sys
from pathlib import Path


def main() -> None:
    converter, pre, hf_dir, out, *rest = sys.argv[1:]
    sys.path.insert(0, converter)
    sys.path.insert(1, str(Path(converter) / "gguf-py"))
    import conversion  # the converter's package, from the extracted sdist

    conversion.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()

"""The steps of `cargo xtask golden`, one per invocation: `python golden/pipeline.py STEP`.

Steps, in order: models, convert, story, quantize, refs, tokenizer_cases, manifest (the quant
fixtures step runs golden/quant_fixtures.py directly). Every step reads what the previous ones wrote,
under target/golden/ (scratch) and golden/ (the committed fixtures), and writes deterministically.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent
ROOT = GOLDEN.parent
WORK = ROOT / "target" / "golden"
CONVERTER = WORK / "converter"
HF = WORK / "hf"
SCRATCH = WORK / "gguf"  # files only needed to make or check others: not committed
MODELS = GOLDEN / "models"
REFS = GOLDEN / "refs"
PY = sys.executable

# The golden prompts: about 8 and 25 tokens. The longer one is longer than ds3's YaRN original
# context (16) and glm5's DSA index_topk (8). Two keep the references small.
PROMPTS = [
    "And God called the light Day",
    "And Noah was 600 years old when the flood of waters was upon the earth, and he went in.",
]

PRE_TOKENIZER = {"ds3": "deepseek-v3", "v2lite": "deepseek-v3", "glm5": "glm4", "story": "deepseek-v3"}

# Every GGUF: (file, model, how it is made). Files under SCRATCH are not committed.
MIX_OVERRIDES = [
    # one type per tensor family, so that every type of the mix lands on rows of 256
    (r"token_embd", "q4_k"),
    (r"attn_q_a\.", "q5_k"),
    (r"attn_kv_a_mqa", "q6_k"),
    (r"ffn_(gate|up)_exps", "iq4_xs"),
    (r"ffn_(gate|up)_shexp", "q5_k"),
    (r"ffn_(gate|up)\.", "q6_k"),
    (r"attn_k_b", "q5_0"),
    (r"output\.weight", "q8_0"),
]
FILES = {
    "ds3.f32": ("ds3", "converter --outtype f32"),
    "ds3.q8_0": ("ds3", "converter --outtype q8_0"),
    "ds3.q4_k_m": ("ds3", "llama_model_quantize Q4_K_M from ds3.f32"),
    "ds3.mix": ("ds3", "llama_model_quantize Q8_0 with per-tensor overrides from ds3.f32"),
    "ds3.legacy-q8_0": ("ds3", "ds3.f32 rewritten to the legacy attn_kv_b layout, then llama_model_quantize Q8_0"),
    "glm5.f32": ("glm5", "converter --outtype f32 (scratch: only for the llama.cpp agreement check)"),
    "glm5.q8_0": ("glm5", "converter --outtype q8_0"),
    "v2lite.f32": ("v2lite", "converter --outtype f32 (scratch: only for the checkpoint check)"),
    "v2lite.q8_0": ("v2lite", "converter --outtype q8_0 --split-max-tensors 20: a split set of 3 shards"),
    "story.q8_0": ("story", "story.py (ds3 layout trained on Genesis), converter --outtype q8_0"),
}
SCRATCH_FILES = {"glm5.f32", "v2lite.f32", "ds3.legacy-f32"}
# Files whose references stay in target/ (the manifest keeps their figures): size.
SCRATCH_REFS = SCRATCH_FILES | {"story.q8_0"}
V2LITE_SPLIT_TENSORS = 20


def gguf_path(name: str) -> Path:
    """The first (or only) file of a GGUF by fixture name."""
    if name == "v2lite.q8_0":
        return MODELS / "v2lite.q8_0-00001-of-00003.gguf"
    return (SCRATCH if name in SCRATCH_FILES else MODELS) / f"{name}.gguf"


def run(cmd: list) -> None:
    subprocess.run([str(c) for c in cmd], check=True)


def step_models() -> None:
    run([PY, GOLDEN / "tiny_models.py", HF])


def convert(model: str, out: Path, *args) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    run([PY, GOLDEN / "convert.py", CONVERTER, PRE_TOKENIZER[model], HF / model, out, *args])


def step_convert() -> None:
    for stale in MODELS.glob("*.gguf"):
        stale.unlink()
    convert("ds3", gguf_path("ds3.f32"), "--outtype", "f32")
    convert("ds3", gguf_path("ds3.q8_0"), "--outtype", "q8_0")
    convert("glm5", gguf_path("glm5.f32"), "--outtype", "f32")
    convert("glm5", gguf_path("glm5.q8_0"), "--outtype", "q8_0")
    convert("v2lite", gguf_path("v2lite.f32"), "--outtype", "f32")
    convert("v2lite", MODELS / "v2lite.q8_0.gguf", "--outtype", "q8_0",
            "--split-max-tensors", str(V2LITE_SPLIT_TENSORS))
    shards = sorted(MODELS.glob("v2lite.q8_0-*.gguf"))
    if len(shards) != 3:
        raise SystemExit(f"expected 3 v2lite shards, got {[s.name for s in shards]}")


def step_story() -> None:
    run([PY, GOLDEN / "story.py", HF, HF / "story", WORK / "summaries" / "story.train.json"])
    convert("story", gguf_path("story.q8_0"), "--outtype", "q8_0")


def step_quantize() -> None:
    run([PY, GOLDEN / "quantize.py", "ftype", gguf_path("ds3.f32"), gguf_path("ds3.q4_k_m"), "Q4_K_M"])
    overrides = [f"{pattern}={qtype}" for pattern, qtype in MIX_OVERRIDES]
    run([PY, GOLDEN / "quantize.py", "mix", gguf_path("ds3.f32"), gguf_path("ds3.mix"), *overrides])
    legacy_f32 = gguf_path("ds3.legacy-f32")
    run([PY, GOLDEN / "legacy.py", gguf_path("ds3.f32"), legacy_f32])
    run([PY, GOLDEN / "quantize.py", "ftype", legacy_f32, gguf_path("ds3.legacy-q8_0"), "Q8_0"])


def step_refs() -> None:
    for stale in REFS.glob("*.safetensors"):
        stale.unlink()
    for name, (model, _) in FILES.items():
        path = gguf_path(name)
        prefix = (WORK / "refs" if name in SCRATCH_REFS else REFS) / name
        cmd = [PY, GOLDEN / "reference.py", "--gguf", path, "--tokenizer", HF / model,
               "--out", prefix, "--summary", WORK / "summaries" / f"{name}.json", "--llamacpp"]
        if name.endswith(".f32"):
            cmd += ["--hf-checkpoint", HF / model]
        for prompt in PROMPTS:
            cmd += ["--prompt", prompt]
        print(f"  {name}", flush=True)
        run(cmd)


def step_tokenizer_cases() -> None:
    run([PY, GOLDEN / "tokenizer_cases.py", HF, GOLDEN / "tokenizer_cases.json"])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_manifest() -> None:
    run([PY, GOLDEN / "manifest.py"])


STEPS = {
    "models": step_models,
    "convert": step_convert,
    "story": step_story,
    "quantize": step_quantize,
    "refs": step_refs,
    "tokenizer_cases": step_tokenizer_cases,
    "manifest": step_manifest,
}

if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    STEPS[sys.argv[1]]()

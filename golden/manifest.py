"""Writes golden/manifest.json: what every fixture is, how it was made and what it measured.

    python golden/manifest.py

Reads the per-file summaries that reference.py left under target/golden/summaries/ and the
fixtures themselves. `files` maps every committed fixture (relative to golden/) to its sha256
and size; tests/manifest.rs checks them without Python.
"""

import importlib.metadata
import json
import platform
import sys
from collections import Counter
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline  # noqa: E402
import tiny_models  # noqa: E402

HASHED_DIRS = ["models", "refs", "quant"]


def versions() -> dict:
    out = {"python": platform.python_version()}
    for package in ["torch", "transformers", "gguf", "safetensors", "numpy", "tokenizers", "llama_cpp_python"]:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    out["converter"] = "convert_hf_to_gguf.py from the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp)"
    out["converter_sha256"] = pipeline.sha256(pipeline.CONVERTER / "convert_hf_to_gguf.py")
    return out


def tensor_types(first: Path) -> dict:
    counts = Counter()
    for shard in sorted(first.parent.glob(first.name.replace("-00001-of-", "-*-of-"))) or [first]:
        for t in gguf.GGUFReader(shard).tensors:
            counts[t.tensor_type.name] += 1
    return dict(sorted(counts.items()))


def main() -> None:
    golden = pipeline.GOLDEN
    files = {}
    for d in HASHED_DIRS:
        for path in sorted((golden / d).glob("*")):
            if path.is_file() and path.name != ".gitkeep":
                files[f"{d}/{path.name}"] = {"sha256": pipeline.sha256(path), "bytes": path.stat().st_size}
    cases = golden / "tokenizer_cases.json"
    files["tokenizer_cases.json"] = {"sha256": pipeline.sha256(cases), "bytes": cases.stat().st_size}

    ggufs = {}
    for name, (model, made_by) in pipeline.FILES.items():
        path = pipeline.gguf_path(name)
        summary = json.loads((pipeline.WORK / "summaries" / f"{name}.json").read_text())
        entry = {
            "model": model,
            "made_by": made_by,
            "committed": name not in pipeline.SCRATCH_FILES,
            "files": sorted(f for f in files if f.startswith(f"models/{name}.") or f.startswith(f"models/{name}-")),
            "tensor_types": tensor_types(path),
            "prompts": summary["prompts"],
        }
        if "max_abs_diff_vs_hf_checkpoint" in summary:
            entry["max_abs_diff_vs_hf_checkpoint"] = summary["max_abs_diff_vs_hf_checkpoint"]
        if name not in pipeline.SCRATCH_REFS:
            entry["refs"] = sorted(f for f in files if f.startswith(f"refs/{name}.p"))
        ggufs[name] = entry

    models = {}
    for name, (_, _, _, extra, family, seed) in tiny_models.MODELS.items():
        config = json.loads((pipeline.HF / name / "config.json").read_text())
        models[name] = {"seed": seed, "tokenizer": family, "pre_tokenizer": pipeline.PRE_TOKENIZER[name],
                        "config": config}

    story = json.loads((pipeline.HF / "story" / "config.json").read_text())
    models["story"] = {
        "tokenizer": "ds",
        "pre_tokenizer": pipeline.PRE_TOKENIZER["story"],
        "training": json.loads((pipeline.WORK / "summaries" / "story.train.json").read_text()),
        "config": story,
    }

    manifest = {
        "about": "Written by `cargo xtask golden`; see golden/README.md. Do not edit.",
        "tools": versions(),
        "text": "text/genesis.txt (KJV Genesis, Debian bible-kjv-text 4.38)",
        "prompts": pipeline.PROMPTS,
        "models": models,
        "mix_overrides": [f"{p}={t}" for p, t in pipeline.MIX_OVERRIDES],
        "gguf": ggufs,
        "relative_error": "||a - b||_F / ||b||_F over the whole tensor; noise = f32 run vs f64 run",
        "files": files,
    }
    (golden / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

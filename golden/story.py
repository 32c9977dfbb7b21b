"""The `story` model: the ds3 layout trained briefly on Genesis, so generation reads like text.

    python golden/story.py HF_DIR OUT_HF_DIR SUMMARY.json [STEPS]

Trains a fixed number of steps (not a time budget, so two runs give the same weights) on one
CPU thread, on the first 90% of the verses; the last 10% are held out for the perplexity that
the manifest records. Writes a Hugging Face checkpoint for llama.cpp's converter.
"""

import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models  # noqa: E402

SEED = 7
STEPS = 1200  # about 7 minutes on one thread of the development machine
BATCH = 16
SEQ = 64
LR = 3e-3
PROMPT = "And God said unto Noah"


def batches(ids: torch.Tensor, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=gen)
        yield torch.stack([ids[s : s + SEQ + 1] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    losses = []
    for s in range(0, len(ids) - SEQ - 1, SEQ):
        chunk = ids[s : s + SEQ + 1].unsqueeze(0)
        losses.append(float(model(chunk[:, :-1], labels=chunk[:, :-1]).loss))
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    hf, out, summary = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else STEPS
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)

    tok = AutoTokenizer.from_pretrained(hf / "ds3")
    verses = tiny_models.TEXT.read_text().splitlines()
    cut = len(verses) * 9 // 10
    encode = lambda lines: torch.tensor([i for line in lines for i in tok(line + "\n")["input_ids"]])
    train, held_out = encode(verses[:cut]), encode(verses[cut:])

    fields = dict(tiny_models.DS3, max_position_embeddings=256)
    fields["rope_parameters"] = dict(fields["rope_parameters"], original_max_position_embeddings=64)
    config = DeepseekV3Config(**fields)
    config._experts_implementation = "eager"
    model = DeepseekV3ForCausalLM(config).float()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    schedule = lambda step: min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(SEED)
    started = time.time()
    model.train()
    for step, batch in zip(range(steps), batches(train, gen)):
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        # labels are shifted inside the model: predicting token t+1 from tokens <= t
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"    step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)
    model.eval()

    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    result = {
        "seed": SEED,
        "steps": steps,
        "batch": BATCH,
        "seq": SEQ,
        "train_tokens": len(train),
        "held_out_tokens": len(held_out),
        "held_out_perplexity": perplexity(model, held_out),
        "greedy_prompt": PROMPT,
        "greedy_text": tok.decode(ids, skip_special_tokens=True),
    }
    print(f"    held-out perplexity {result['held_out_perplexity']:.1f}: {result['greedy_text']!r}")

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(out)
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

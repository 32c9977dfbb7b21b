"""Tiny MLA + MoE checkpoints in Hugging Face format, and the BPE tokenizers they use.

`python golden/tiny_models.py OUT_DIR` writes OUT_DIR/{ds3,glm5,v2lite}/ (config.json,
model.safetensors, tokenizer files): the input of llama.cpp's converter. Everything is drawn
from fixed seeds, so two runs write identical files.

The weights are not trained; they are scaled (see `init_weights`) so that the residual stream
stays near unit size, the router has decisive preferences and the logits are far from uniform:
a wrong stage then changes the output visibly.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    PreTrainedTokenizerFast,
)

GOLDEN = Path(__file__).resolve().parent
TEXT = GOLDEN / "text" / "genesis.txt"
VOCAB = 1000

# The DeepSeek-V3 pre-tokenizer (llama.cpp calls it `deepseek-v3`): digits in groups of three,
# CJK runs, then a GPT-style word/punctuation/space split.
DS_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
DS_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>"]
DS_CHAT = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

# The GLM-4/GLM-5 pre-tokenizer (llama.cpp: `glm4`).
GLM_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_CHAT = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE with the family's pre-tokenizer and special tokens, trained on Genesis."""
    if family == "ds":
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DS_SPLITS]
        specials = DS_SPECIALS
    else:
        splits = [pre_tokenizers.Split(Regex(GLM_SPLIT), behavior="isolated")]
        specials = GLM_SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT.read_text().splitlines(), trainer=trainer)
    if family == "ds":
        bos = DS_SPECIALS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=bos,
            eos_token=DS_SPECIALS[1],
            pad_token=DS_SPECIALS[2],
            add_bos_token=True,
            chat_template=DS_CHAT,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=GLM_CHAT
    )


# Shapes: hidden 256 (so rows of 256 exist for K-quants), 4 heads, one dense layer then two MoE
# layers. Every model keeps its MLA head dims different from each other so a swapped dim shows.
DS3 = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
    # YaRN with an original context (16) shorter than the longest golden prompt.
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    rope_interleave=True,
)
GLM5 = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
    n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=0, pad_token_id=0,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    # DSA: top-8 keys per query; layer 1 reuses layer 0's choice. llama.cpp rotates indexer
    # heads by a Hadamard matrix of at least 64, so the head is 64 wide.
    index_topk=8, index_head_dim=64, index_n_heads=16, indexer_types=["full", "shared", "full"],
)
V2LITE = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48,
    n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2,
    routed_scaling_factor=1.0, norm_topk_prob=False, topk_method="greedy", first_k_dense_replace=1,
    max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)

# name: (config class, model class, config, extra config.json keys, tokenizer family, seed).
# Seeds are chosen so that no expert or DSA choice on the golden prompts is within 1e-4 of
# flipping (reference.py records these margins in the manifest).
MODELS = {
    "ds3": (DeepseekV3Config, DeepseekV3ForCausalLM, DS3,
            {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, "ds", 3),
    "glm5": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, GLM5,
             {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, "glm", 25),
    "v2lite": (DeepseekV2Config, DeepseekV2ForCausalLM, V2LITE,
               {"scoring_func": "softmax", "topk_method": "greedy"}, "ds", 22),
}


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Draws every parameter and buffer from one generator, in sorted name order."""
    gen = torch.Generator().manual_seed(seed)
    state = dict(model.named_parameters()) | {
        n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    }
    hidden = model.config.hidden_size
    for name in sorted(state):
        p = state[name]
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            value = 0.1 * noise  # moves the selection, not the weights
        elif p.dim() == 1 and name.endswith(".bias"):
            value = 0.1 * noise
        elif p.dim() == 1:
            value = 1.0 + 0.1 * noise  # norm gains
        elif name.endswith("embed_tokens.weight"):
            value = noise
        elif name.endswith("lm_head.weight"):
            value = noise * (3.0 / hidden**0.5)  # logits with a std of about 3
        elif name.endswith("gate.weight"):
            value = noise * (2.0 / hidden**0.5)  # decisive router
        else:
            value = noise / p.shape[-1] ** 0.5  # unit gain on the input dimension
        p.copy_(value)


def write_model(name: str, out: Path, tokenizers: dict) -> None:
    config_cls, model_cls, fields, extra, family, seed = MODELS[name]
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    init_weights(model, seed)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(extra)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tokenizers[family].save_pretrained(d)


def main() -> None:
    out = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    tokenizers = {family: train_tokenizer(family) for family in ("ds", "glm")}
    for name in MODELS:
        write_model(name, out, tokenizers)
        print(f"  {name}: {out / name}")


if __name__ == "__main__":
    main()

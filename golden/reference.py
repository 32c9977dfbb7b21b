"""Stage-by-stage references for one GGUF file, from HF transformers on the file's own weights.

    python golden/reference.py --gguf FILE [--tokenizer HF_DIR] --prompt TEXT [--prompt TEXT ...]
                               --out PREFIX [--summary FILE.json] [--llamacpp]

The file's metadata becomes a transformers config and its tensors, dequantized by gguf-py,
become the state dict (the converter's renames and splits undone). Transformers then runs the
prompts with forward hooks on every stage of the contract in golden/README.md, once in float32
(the reference written to PREFIX.p{k}.safetensors) and once in float64 (only to measure how much
of the float32 result is rounding: the `noise` per stage in the summary). With --llamacpp the
file is also run by llama.cpp in a subprocess and its logits are stored as `llamacpp_logits`.

The same path serves any deepseek2 / glm-dsa file, including a slice of a real checkpoint
(`cargo xtask golden --from-gguf`): nothing here knows about the tiny golden models.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.numpy import save_file

GOLDEN = Path(__file__).resolve().parent
GREEDY_TOKENS = 16


# ---------------------------------------------------------------- GGUF reading


def shard_paths(path: Path) -> list[Path]:
    """All files of a split set given its first shard (or just `path`)."""
    m = re.match(r"(.*)-(\d{5})-of-(\d{5})\.gguf$", path.name)
    if not m:
        return [path]
    count = int(m.group(3))
    return [path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def field_value(field):
    value = field.contents()
    return value


def read_gguf(path: Path) -> tuple[dict, dict, dict]:
    """(metadata, name -> dequantized float32 array in numpy order, name -> ggml type name)."""
    meta, tensors, types = {}, {}, {}
    for i, shard in enumerate(shard_paths(path)):
        reader = gguf.GGUFReader(shard)
        if i == 0:
            for key, field in reader.fields.items():
                if not key.startswith("GGUF."):
                    meta[key] = field_value(field)
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            tensors[t.name] = np.asarray(values, dtype=np.float32).reshape(shape)
            types[t.name] = t.tensor_type.name
    return meta, tensors, types


# ---------------------------------------------------------------- GGUF -> transformers


def hf_config(meta: dict):
    """The transformers config class, model class and config equivalent to the file's metadata."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        GlmMoeDsaConfig,
        GlmMoeDsaForCausalLM,
    )

    arch = meta["general.architecture"]
    if arch not in ("deepseek2", "glm-dsa"):
        raise SystemExit(f"reference.py: architecture {arch!r} is not supported (deepseek2, glm-dsa)")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    rope = int(get("rope.dimension_count"))
    if get("attention.key_length_mla") is not None:
        nope = int(get("attention.key_length_mla")) - rope
        v_dim = int(get("attention.value_length_mla"))
    else:  # legacy layout: key/value lengths are the per-head MHA sizes
        nope = int(get("attention.key_length")) - rope
        v_dim = int(get("attention.value_length"))
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    gating = int(get("expert_gating_func", 1))  # llama.cpp's default when absent is softmax
    vocab = len(meta["tokenizer.ggml.tokens"])
    fields = dict(
        vocab_size=vocab,
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(get("attention.head_count")),
        q_lora_rank=None if get("attention.q_lora_rank") is None else int(get("attention.q_lora_rank")),
        kv_lora_rank=int(get("attention.kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        n_routed_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")),
        n_shared_experts=int(get("expert_shared_count", 0)),
        n_group=int(get("expert_group_count", 1)),
        topk_group=int(get("expert_group_used_count", 1)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(np.float32(get("attention.layer_norm_rms_epsilon"))),
        tie_word_embeddings="output.weight" not in meta.get("_tensor_names", ()),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    rope_parameters = dict(rope_type="default", rope_theta=float(get("rope.freq_base", 10000.0)))
    if get("rope.scaling.type") == "yarn":
        # GGUF keeps 0.1 * mscale_all_dim; real DeepSeek checkpoints have mscale == mscale_all_dim,
        # which is what llama.cpp assumes too.
        mscale_all_dim = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope_parameters.update(
            rope_type="yarn",
            factor=float(get("rope.scaling.factor")),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            mscale=mscale_all_dim,
            mscale_all_dim=mscale_all_dim,
        )
    fields["rope_parameters"] = rope_parameters

    if arch == "glm-dsa":
        if gating != 2:
            raise SystemExit("reference.py: glm-dsa with softmax routing is not supported by transformers")
        types = get("attention.indexer.types")
        fields.update(
            index_topk=int(get("attention.indexer.top_k")),
            index_head_dim=int(get("attention.indexer.key_length")),
            index_n_heads=int(get("attention.indexer.head_count")),
            indexer_types=None if types is None else ["full" if t else "shared" for t in types],
        )
        return GlmMoeDsaConfig, GlmMoeDsaForCausalLM, GlmMoeDsaConfig(**fields)
    if gating == 2:
        fields.update(rope_interleave=True)
        return DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Config(**fields)
    if fields["norm_topk_prob"]:
        raise SystemExit("reference.py: softmax routing with expert_weights_norm is not in transformers' DeepseekV2")
    fields.update(topk_method="greedy" if fields["n_group"] == 1 else "group_limited_greedy")
    return DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV2Config(**fields)


LAYER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
}
GLOBAL_RENAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_state_dict(tensors: dict, n_layers: int) -> dict:
    """HF parameter names and layouts for the GGUF tensors (numpy order: ggml's ne reversed)."""
    sd = {}
    for name, value in tensors.items():
        if name in GLOBAL_RENAMES:
            sd[GLOBAL_RENAMES[name]] = value
            continue
        m = re.match(r"blk\.(\d+)\.(.*)$", name)
        if not m:
            raise SystemExit(f"reference.py: tensor {name!r} has no transformers counterpart")
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= n_layers:  # the MTP block of GLM files
            continue
        prefix = f"model.layers.{layer}."
        if rest in LAYER_RENAMES:
            sd[prefix + LAYER_RENAMES[rest]] = value
        elif rest in ("attn_k_b.weight", "attn_v_b.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"):
            pass  # joined below
        else:
            raise SystemExit(f"reference.py: tensor {name!r} has no transformers counterpart")
    for layer in range(n_layers):
        blk, prefix = f"blk.{layer}.", f"model.layers.{layer}."
        if blk + "attn_k_b.weight" in tensors:
            # attn_k_b: [H, kv_lora, nope] is W_UK transposed per head; attn_v_b: [H, dv, kv_lora].
            k_b = np.transpose(tensors[blk + "attn_k_b.weight"], (0, 2, 1))
            v_b = tensors[blk + "attn_v_b.weight"]
            kv_b = np.concatenate([k_b, v_b], axis=1)  # per head: [nope rows | dv rows]
            sd[prefix + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        if blk + "ffn_gate_exps.weight" in tensors:
            # [n_exp, F, E] each; transformers fuses them as [n_exp, 2F, E], gate first.
            gate_up = [tensors[blk + "ffn_gate_exps.weight"], tensors[blk + "ffn_up_exps.weight"]]
            sd[prefix + "mlp.experts.gate_up_proj"] = np.concatenate(gate_up, axis=1)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def load_model(path: Path):
    meta, tensors, types = read_gguf(path)
    meta["_tensor_names"] = set(tensors)
    _, model_cls, config = hf_config(meta)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the plain per-expert loop, in any dtype
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    state = hf_state_dict(tensors, config.num_hidden_layers)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # inv_freq buffers are computed, not stored; anything else missing is a mapping error.
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise SystemExit(f"reference.py: {path}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return meta, types, model


# ---------------------------------------------------------------- tokenizer from GGUF


def gguf_tokenizer(meta: dict):
    """A `tokenizers` BPE tokenizer rebuilt from the file's gpt2 vocabulary (for --from-gguf)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    sys.path.insert(0, str(GOLDEN))
    from tiny_models import DS_SPLITS, GLM_SPLIT

    pre = meta.get("tokenizer.ggml.pre")
    splits = {"deepseek-v3": DS_SPLITS, "glm4": [GLM_SPLIT], "glm5": [GLM_SPLIT]}.get(pre)
    if meta.get("tokenizer.ggml.model") != "gpt2" or splits is None:
        raise SystemExit(f"reference.py: tokenizer {meta.get('tokenizer.ggml.model')}/{pre} not supported; pass --tokens")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    types = list(meta["tokenizer.ggml.token_type"])
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty in (3, 4)])
    bos = meta.get("tokenizer.ggml.bos_token_id") if meta.get("tokenizer.ggml.add_bos_token") else None
    return lambda text: ([bos] if bos is not None else []) + tok.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- stage capture


def to_adjacent_pairs(x: torch.Tensor) -> torch.Tensor:
    """HF's interleaved-rope output is [rotated evens | rotated odds]; put pairs back side by side."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).flatten(-2)


class Capture:
    """Forward hooks that record every stage of one forward pass, as [T, ...] tensors."""

    def __init__(self, model):
        self.model = model
        self.stages: dict[str, torch.Tensor] = {}
        self.layer = None
        self.handles = []
        self.restore = []
        cfg = model.config
        self.sigmoid = hasattr(model.model.layers[-1].mlp, "gate") and hasattr(
            model.model.layers[-1].mlp.gate, "e_score_correction_bias"
        )
        self.index_topk = getattr(cfg, "index_topk", None)

    def put(self, name, value):
        self.stages[name] = value.detach()

    def hook(self, module, name_fn, pre=False):
        if pre:
            h = module.register_forward_pre_hook(lambda m, args: name_fn(args[0]))
        else:
            h = module.register_forward_hook(lambda m, args, out: name_fn(out))
        self.handles.append(h)

    def patch_rope(self):
        """Wraps the modeling module's rope function to record q_pe and k_pe after rope."""
        modeling = sys.modules[type(self.model).__module__]
        for fn_name in ("apply_rotary_pos_emb_interleave", "apply_rotary_emb"):
            original = getattr(modeling, fn_name, None)
            if original is None:
                continue
            adjacent = fn_name == "apply_rotary_emb"  # V2's complex rope keeps pairs adjacent

            def wrapped(*args, _orig=original, _adjacent=adjacent, **kwargs):
                q, k = _orig(*args, **kwargs)
                # The DSA indexer uses the same function with unsqueeze_dim=2; skip it.
                if kwargs.get("unsqueeze_dim", 1) == 1 and self.layer is not None:
                    qa, ka = (q, k) if _adjacent else (to_adjacent_pairs(q), to_adjacent_pairs(k))
                    t = qa.shape[2]
                    self.put(f"L{self.layer}.q_pe", qa[0].permute(1, 0, 2).reshape(t, -1))
                    self.put(f"L{self.layer}.k_pe", ka[0, 0])
                return q, k

            setattr(modeling, fn_name, wrapped)
            self.restore.append((modeling, fn_name, original))

    def install(self):
        m = self.model.model
        self.hook(m.embed_tokens, lambda o: self.put("embed", o[0]))
        self.hook(m.norm, lambda o: self.put("final_norm", o[0]))
        for i, layer in enumerate(m.layers):
            self.install_layer(i, layer)
        self.patch_rope()

    def install_layer(self, i, layer):
        p = f"L{i}."

        def enter(args):
            self.layer = i

        self.hook(layer, enter, pre=True)
        self.hook(layer.input_layernorm, lambda o: self.put(p + "attn_norm", o[0]))
        attn = layer.self_attn
        q_proj = attn.q_b_proj if getattr(attn, "q_b_proj", None) is not None else attn.q_proj
        self.hook(q_proj, lambda o: self.put(p + "q", o[0]))
        self.hook(attn.kv_a_layernorm, lambda o: self.put(p + "c_kv", o[0].reshape(-1, o.shape[-1])))
        self.hook(attn.o_proj, lambda x: self.put(p + "attn_core", x[0]), pre=True)
        self.hook(attn.o_proj, lambda o: self.put(p + "attn_out", o[0]))
        if self.index_topk is not None:
            self.hook(attn, lambda o: self.put(p + "dsa_topk", self.kept_keys(o[2][0])))
            if attn.indexer is not None:
                h = attn.indexer.register_forward_hook(
                    lambda m, args, kwargs, out: self.put_index_margin(p, m, args, kwargs), with_kwargs=True
                )
                self.handles.append(h)
        self.hook(layer.post_attention_layernorm, lambda x: self.put(p + "h_attn", x[0]), pre=True)
        self.hook(layer.post_attention_layernorm, lambda o: self.put(p + "ffn_norm", o[0]))
        mlp = layer.mlp
        if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            self.hook(mlp.gate, lambda o: self.put_router(p, mlp.gate, o))
            self.hook(mlp.experts, lambda o: self.put(p + "moe_out", o))
            self.hook(mlp.shared_experts, lambda o: self.put(p + "shared_out", o[0]))
        else:
            self.hook(mlp, lambda o: self.put(p + "ffn_out", o[0]))
        self.hook(layer, lambda o: self.put(p + "h_out", (o[0] if isinstance(o, tuple) else o)[0]))

    def kept_keys(self, topk):
        """[T, topk] indices -> per query the causal keys kept, ascending, -1 padded to index_topk."""
        t = topk.shape[0]
        out = torch.full((t, self.index_topk), -1, dtype=torch.int32)
        for q in range(t):
            keys = sorted(int(k) for k in topk[q] if int(k) <= q)
            out[q, : len(keys)] = torch.tensor(keys, dtype=torch.int32)
        return out

    def put_index_margin(self, p, indexer, args, kwargs):
        """Smallest gap between the last kept and the first dropped key's index score."""
        hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
        t = hidden.shape[1]
        if t <= indexer.index_topk:
            return
        q = indexer.wq_b(q_resid).view(1, t, indexer.n_heads, indexer.head_dim)
        k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
        r = indexer.qk_rope_head_dim
        modeling = sys.modules[type(indexer).__module__]
        q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], -1).double()
        k = torch.cat([k_rot, k[..., r:]], -1).squeeze(2).double()
        scores = torch.relu(torch.einsum("bshd,btd->bsht", q, k)) * indexer.softmax_scale
        w = indexer.weights_proj(hidden).double() * indexer.n_heads**-0.5
        index = torch.einsum("bsh,bsht->bst", w, scores)[0]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        index = index.masked_fill(~causal, float("-inf"))
        top = index[indexer.index_topk :].topk(indexer.index_topk + 1, dim=-1).values
        self.put(p + "dsa_margin", (top[:, -2] - top[:, -1]).min().reshape(1))

    def put_router(self, p, gate, out):
        logits, weights, ids = out
        if self.sigmoid:
            choice = logits.sigmoid() + gate.e_score_correction_bias.to(logits.dtype)
        else:
            choice = logits.softmax(dim=-1)
        order = torch.argsort(choice.gather(1, ids), dim=-1, descending=True, stable=True)
        self.put(p + "router_logits", logits)
        self.put(p + "topk_ids", ids.gather(1, order).to(torch.int32))
        self.put(p + "topk_weights", weights.gather(1, order))

    def remove(self):
        for h in self.handles:
            h.remove()
        for module, name, original in self.restore:
            setattr(module, name, original)


@torch.no_grad()
def run_stages(model, ids: list[int]) -> dict:
    cap = Capture(model)
    cap.install()
    try:
        out = model(torch.tensor([ids]))
    finally:
        cap.remove()
    stages = dict(cap.stages)
    stages["logits"] = out.logits[0].detach()
    return stages


def split_margins(stages: dict) -> tuple[dict, dict]:
    """(contract stages, dsa margins): the margins are diagnostics, not stages."""
    margins = {k: v for k, v in stages.items() if k.endswith("dsa_margin")}
    return {k: v for k, v in stages.items() if k not in margins}, margins


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by full forward passes (no KV cache involved)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    norm = b.norm()
    return float((a - b).norm() / norm) if norm > 0 else float((a - b).norm())


def margins(stages: dict, model) -> dict:
    """How close the discrete choices are to flipping (smaller = more fragile)."""
    out = {name[: -len("_margin")]: float(v) for name, v in stages.items() if name.endswith("dsa_margin")}
    for name, logits in stages.items():
        if not name.endswith("router_logits"):
            continue
        p = name[: -len("router_logits")]
        k = stages[p + "topk_ids"].shape[1]
        layer = model.model.layers[int(p[1:-1])]
        gate = layer.mlp.gate
        logits = logits.double()
        if hasattr(gate, "e_score_correction_bias"):
            choice = logits.sigmoid() + gate.e_score_correction_bias.double()
        else:
            choice = logits.softmax(-1)
        groups, used = model.config.n_group or 1, model.config.topk_group or 1
        if hasattr(gate, "e_score_correction_bias") and groups > 1:
            per_group = choice.view(choice.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1)
            top = per_group.topk(used + 1, dim=-1).values
            out[p + "groups"] = float((top[:, used - 1] - top[:, used]).min())
            # experts of the dropped groups are out of the running
            kept = per_group >= top[:, used - 1 : used]
            choice = choice.masked_fill(~kept.repeat_interleave(choice.shape[1] // groups, dim=1), float("-inf"))
        top = choice.topk(min(k + 1, choice.shape[1]), dim=-1).values
        out[p + "topk"] = float((top[:, k - 1] - top[:, k]).min()) if top.shape[1] > k else None
    return out


# ---------------------------------------------------------------- llama.cpp peer


def llamacpp_logits(path: Path, ids: list[int], out: Path) -> str | None:
    """Runs golden/llamacpp_logits.py in its own process; returns None or why it failed."""
    cmd = [sys.executable, str(GOLDEN / "llamacpp_logits.py"), str(path), str(out), *map(str, ids)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        lines = [l.strip() for l in (r.stderr + r.stdout).splitlines() if l.strip()]
        # llama.cpp's own reason (a loader error or a failed assertion) rather than Python's
        reasons = [l for l in lines if "error loading model:" in l or "GGML_ASSERT" in l]
        reason = reasons[0] if reasons else (lines[-1] if lines else f"exit status {r.returncode}")
        return re.sub(r"^/\S*/vendor/llama.cpp/", "llama.cpp/", reason)  # no build paths
    return None


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, type=Path, help="the file (first shard of a split set)")
    ap.add_argument("--tokenizer", type=Path, help="HF tokenizer dir; default: rebuilt from the GGUF")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    ap.add_argument("--out", required=True, help="output prefix: writes PREFIX.p{k}.safetensors")
    ap.add_argument("--summary", type=Path, help="JSON summary (noise, agreement, greedy)")
    ap.add_argument("--llamacpp", action="store_true", help="add llama.cpp's logits")
    ap.add_argument("--hf-checkpoint", type=Path, help="HF dir the file was converted from: check max diff")
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # deterministic reductions, the same on every machine
    meta, types, model = load_model(args.gguf)
    if args.tokenizer:
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(args.tokenizer)
        encode = lambda text: hf_tok(text)["input_ids"]
    else:
        encode = gguf_tokenizer(meta)

    model64 = load_model(args.gguf)[2].double()
    model64.config._attn_implementation = "sdpa"  # eager's softmax runs in float32

    checkpoint_diff = None
    if args.hf_checkpoint:
        from transformers import AutoModelForCausalLM

        original = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32).eval()
        mine = model.state_dict()
        checkpoint_diff = max(
            float((mine[k].float() - v.float()).abs().max()) for k, v in original.state_dict().items() if k in mine
        )

    summary = {"file": args.gguf.name, "tensor_types": sorted(set(types.values())), "prompts": []}
    if checkpoint_diff is not None:
        summary["max_abs_diff_vs_hf_checkpoint"] = checkpoint_diff
    for k, text in enumerate(args.prompt):
        ids = encode(text)
        stages, dsa_margins = split_margins(run_stages(model, ids))
        stages64, _ = split_margins(run_stages(model64, ids))
        noise = {}
        for name, value in stages.items():
            if value.is_floating_point():
                noise[name] = rel_err(value, stages64[name])
            else:
                noise[name] = int((value != stages64[name]).sum())  # mismatching ids
        record = {
            "k": k,
            "text": text,
            "tokens": ids,
            "greedy": greedy(model, ids, GREEDY_TOKENS),
            "noise": dict(sorted(noise.items())),
            "margins": margins(stages | dsa_margins, model),
        }
        tensors = {n: v.float().contiguous().numpy() if v.is_floating_point() else v.to(torch.int32).numpy()
                   for n, v in stages.items()}
        tensors["tokens"] = np.array(ids, dtype=np.int32)
        tensors["greedy"] = np.array(record["greedy"], dtype=np.int32)
        if args.llamacpp:
            npy = Path(f"{args.out}.p{k}.llamacpp.npy")
            npy.unlink(missing_ok=True)
            error = llamacpp_logits(args.gguf, ids, npy)
            if error is None:
                lc = np.load(npy)
                npy.unlink()
                tensors["llamacpp_logits"] = lc.astype(np.float32)
                ref = stages["logits"]
                lct = torch.from_numpy(lc)
                record["llamacpp"] = {
                    "rel_err": rel_err(lct, ref),
                    "top1_agree": float((lct.argmax(-1) == ref.argmax(-1)).float().mean()),
                }
            else:
                record["llamacpp"] = {"error": error}
        out = Path(f"{args.out}.p{k}.safetensors")
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(dict(sorted(tensors.items())), str(out))
        summary["prompts"].append(record)
        print(f"    p{k}: {len(ids)} tokens -> {out}", flush=True)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

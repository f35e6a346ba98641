"""Small EAGLE and EAGLE-3 draft heads for the tests' tiny Llama, as vLLM 0.32 loads them.

A "copy" head: its decoder layer's attention and MLP outputs are zero and `fc` passes the
target's last hidden state straight through (EAGLE-3: with the target's final norm and LM head),
so it drafts "the target's last token again". Its drafts are accepted exactly where the target
repeats a token, which a random model does often: mixed acceptance lengths, on vLLM's real
EAGLE path (the target's hidden states in, the shared embeddings, the rejection sampler).

What vLLM needs of a head (read from vllm/model_executor/models/llama_eagle.py, llama_eagle3.py):
- EAGLE: the target's config with one layer; weights `fc` [H, 2H] over (token embedding, target
  hidden state) and `layers.0.*` without `input_layernorm`; the embeddings and LM head are the
  target's.
- EAGLE-3: `LlamaForCausalLMEagle3`, `eagle_aux_hidden_state_layer_ids` (0 = the embeddings),
  `midlayer.*` whose q/k/v take 2H, `hidden_norm`, `norm`, its own `lm_head`, `fc` [H, 3H].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def build_eagle_head(target_dir: str | Path, out_dir: str | Path, method: str, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    assert method in ("eagle", "eagle3"), method
    tgt, out = Path(target_dir), Path(out_dir)
    cfg = json.loads((tgt / "config.json").read_text())
    H, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    def norm():
        return 1.0 + 0.1 * torch.randn(H, generator=g)

    qkv_in = 2 * H if method == "eagle3" else H  # EAGLE-3's layer attends over [embeddings, hidden]
    pre = "midlayer." if method == "eagle3" else "layers.0."
    w = {
        pre + "self_attn.q_proj.weight": rnd(nh * hd, qkv_in),
        pre + "self_attn.k_proj.weight": rnd(nkv * hd, qkv_in),
        pre + "self_attn.v_proj.weight": rnd(nkv * hd, qkv_in),
        pre + "self_attn.o_proj.weight": torch.zeros(H, nh * hd),  # the layer adds nothing: a copy head
        pre + "mlp.gate_proj.weight": rnd(inter, H),
        pre + "mlp.up_proj.weight": rnd(inter, H),
        pre + "mlp.down_proj.weight": torch.zeros(H, inter),
        pre + "post_attention_layernorm.weight": norm(),
    }
    extra: dict = {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}
    if method == "eagle":
        w["fc.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], 1)  # the target's hidden state through
    else:
        target = load_file(str(tgt / "model.safetensors"))
        aux = [0, cfg["num_hidden_layers"] // 2, cfg["num_hidden_layers"]]
        w.update(
            {
                pre + "input_layernorm.weight": norm(),
                pre + "hidden_norm.weight": norm(),
                "fc.weight": torch.cat([torch.zeros(H, (len(aux) - 1) * H), torch.eye(H)], 1),
                "norm.weight": target["model.norm.weight"].clone(),
                "lm_head.weight": target["lm_head.weight"].clone(),
            }
        )
        extra.update(
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=V,
            eagle_aux_hidden_state_layer_ids=aux,
            eagle_config={"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tgt / f).exists():
            shutil.copy(tgt / f, out / f)
    return out


def build_mimo_target(qwen2_dir: str | Path, out_dir: str | Path) -> Path:
    """MiMo (a Qwen2 model with one MTP layer, vLLM's "mtp" method, mimo_mtp.py) from a Qwen2
    folder: the same weights (the LM head untied, as MiMo's MTP layer loads its own), plus
    `model.mtp_layers.0.*` as a copy layer: its attention and MLP add nothing and `input_proj`
    passes the target's hidden state through to the target's own norm, so it drafts the target's
    next token from the last hidden state again. transformers loads the folder as Qwen2 (the MTP
    weights unused): the reference."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(qwen2_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    w = load_file(str(src / "model.safetensors"))
    w.setdefault("lm_head.weight", w["model.embed_tokens.weight"].clone())
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    ones = torch.ones(H)
    mtp = {
        "token_layernorm.weight": ones.clone(),
        "hidden_layernorm.weight": ones.clone(),
        "final_layernorm.weight": w["model.norm.weight"].clone(),
        "input_proj.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], 1),  # (hidden, token) -> hidden
        "input_layernorm.weight": ones.clone(),
        "post_attention_layernorm.weight": ones.clone(),
        "self_attn.q_proj.weight": rnd(nh * hd, H),
        "self_attn.q_proj.bias": rnd(nh * hd),
        "self_attn.k_proj.weight": rnd(nkv * hd, H),
        "self_attn.k_proj.bias": rnd(nkv * hd),
        "self_attn.v_proj.weight": rnd(nkv * hd, H),
        "self_attn.v_proj.bias": rnd(nkv * hd),
        "self_attn.o_proj.weight": torch.zeros(H, nh * hd),
        "mlp.gate_proj.weight": rnd(inter, H),
        "mlp.up_proj.weight": rnd(inter, H),
        "mlp.down_proj.weight": torch.zeros(H, inter),
    }
    w.update({f"model.mtp_layers.0.{k}": v for k, v in mtp.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    cfg.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def build_perturbed_draft(target_dir: str | Path, out_dir: str | Path, scale: float = 0.5, seed: int = 1) -> Path:
    """A draft model that differs from its target: the target's folder with Gaussian noise of
    `scale` times each weight matrix's own standard deviation added to its decoder layers. Same
    tokenizer and vocabulary, so vLLM's draft-model proposer takes it; its drafts agree with the
    target only sometimes, so steps both accept and reject drafts."""
    import torch
    from safetensors.torch import load_file, save_file

    tgt, out = Path(target_dir), Path(out_dir)
    shutil.copytree(tgt, out, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    w = load_file(str(tgt / "model.safetensors"))
    for name, t in w.items():
        if ".layers." in name and t.ndim == 2:
            w[name] = t + scale * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

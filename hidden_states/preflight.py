"""Checks before an engine starts, so a replica that cannot serve says why at once.

vLLM reports start-up failures from another process ("See root cause above"); these checks
raise `EngineStartupError` with the cause and the setting to change: the model folder, the
architecture, and on CPU whether weights plus KV cache fit in the memory available now.
"""

from __future__ import annotations

import json
from pathlib import Path

GiB = 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class EngineStartupError(RuntimeError):
    """An engine that cannot start here; the message names the cause and the fix."""


def check_model_folder(path: str) -> dict | None:
    """The folder's config.json (None for a hub id, which vLLM resolves itself)."""
    folder = Path(path)
    if not folder.exists():
        looks_like_hub_id = path.count("/") == 1 and not path.startswith(("/", ".", "~"))
        if not looks_like_hub_id:
            raise EngineStartupError(
                f"the model folder {path} does not exist: set `model` in the app's args "
                "to a local model folder, a hub id, or builtin:NAME"
            )
        return None  # vLLM resolves "org/name" from the hub (where the network allows)
    if not folder.is_dir():
        raise EngineStartupError(f"the model path {path} is not a folder: `model` must name a model folder")
    config = folder / "config.json"
    if not config.exists():
        raise EngineStartupError(f"the model folder {path} has no config.json: it is not a Hugging Face model folder")
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise EngineStartupError(f"the model folder {path} has an unreadable config.json: {e}") from None
    if not any(f.suffix in WEIGHT_SUFFIXES for f in folder.iterdir()):
        raise EngineStartupError(
            f"the model folder {path} holds no weights (*.safetensors or *.bin): the model cannot load"
        )
    return cfg


def check_architecture(cfg: dict, path: str, supported: set[str]) -> None:
    archs = cfg.get("architectures") or []
    if archs and not any(a in supported for a in archs):
        raise EngineStartupError(
            f"the model at {path} is a {', '.join(archs)}, an architecture this vLLM cannot "
            "run; choose a model vLLM supports (https://docs.vllm.ai/en/latest/models/"
            "supported_models.html)"
        )


def weights_bytes(path: str) -> int:
    folder = Path(path)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES)


def available_memory_bytes() -> int | None:
    """Memory the kernel says a new allocation can use now: MemAvailable, capped by a
    cgroup v2 limit. None where neither can be read."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def check_cpu_memory(path: str, kv_cache_bytes: int | None, available: int | None = None) -> None:
    """Refuses to start a CPU engine whose weights plus KV cache cannot fit."""
    if kv_cache_bytes is None:
        return
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    weights = weights_bytes(path)
    need = weights + kv_cache_bytes
    if need > available:
        raise EngineStartupError(
            f"not enough memory: the KV cache (engine.kv_cache_memory_bytes = {kv_cache_bytes / GiB:.2f} GiB) plus "
            f"the model weights ({weights / GiB:.2f} GiB) need {need / GiB:.2f} GiB, and this machine has "
            f"{available / GiB:.2f} GiB available; lower `engine.kv_cache_memory_bytes` in the app's args "
            "(config.yaml), or use a smaller model or a larger machine"
        )

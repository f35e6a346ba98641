"""torchvision's Python image transforms on a torch its C ops were not built for.

PyPI's `torchvision==0.28.0` (the one pinned to torch 2.13) is built against CUDA's torch. Against
`torch 2.13.0+cpu` its C extension (`torchvision/_C.so`: detection ops such as nms and roi_align)
does not load. torchvision copes with that everywhere but in one place: `_meta_registrations.py`
registers fake kernels for `torchvision::nms` and `torchvision::qnms` unconditionally, and
registering a fake kernel for an operator that was never defined raises ("operator
torchvision::nms does not exist"), so `import torchvision` fails, and with it transformers'
image processors and vLLM's multimodal models.

`install()` puts an import hook on `sys.meta_path` (at interpreter start, through the `.pth`
file scripts/setup.sh writes: every process of the venv, vLLM's engine core and workers too).
When torchvision is first imported, the hook tries its C extension; only if that fails does it
define the two operators' schemas, so the fake registrations find them. Nothing else changes:
the transforms (resize, normalise, crop: what image preprocessing runs) are Python; the detection
ops stay unavailable and raise if called (`torchvision.extension._has_ops()` is False). Where the
matching `+cpu` torchvision is installed, its C extension loads and the hook does nothing.
"""

from __future__ import annotations

import importlib.util
import sys

# The schemas of the two operators `_meta_registrations.py` registers fakes for unconditionally
# (as torchvision's C++ library defines them).
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list = []  # keeps the definitions alive


def define_missing_ops(package_dir: str) -> bool:
    """Defines SCHEMAS unless torchvision's C extension in `package_dir` loads; True if it defined them."""
    import os

    import torch

    try:
        torch.ops.load_library(os.path.join(package_dir, "_C.so"))
        return False
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        lib.define(schema)
    _LIBRARIES.append(lib)
    return True


class _Hook:  # a sys.meta_path finder (importlib.abc is not imported: this runs at every interpreter start)
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once: the real finder does the import
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            define_missing_ops(list(spec.submodule_search_locations)[0])
        return spec


def install() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())

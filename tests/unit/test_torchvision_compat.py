"""hidden_states/torchvision_compat.py, as scripts/setup.sh installs it: where no `+cpu` torchvision was
found, PyPI's (a CUDA build) imports on the +cpu torch through the .pth hook in every interpreter of the
venv, its Python transforms run, and its C detection ops stay unavailable. Without the hook the same
import fails, so the hook is what makes it work."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

PTH = Path(sysconfig.get_paths()["purelib"]) / "hidden_states_torchvision.pth"
CODE = (
    "import torch, torchvision\nfrom torchvision.transforms.v2 import functional as F\n"
    "print(tuple(F.resize(torch.rand(3, 64, 48), [32, 32]).shape), torchvision.extension._has_ops())\n"
)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


@pytest.mark.skipif(not PTH.exists(), reason="a +cpu torchvision is installed: set-up wrote no hook")
def test_a_fresh_interpreter_imports_torchvision_through_the_hook_and_fails_without_it():
    ok = run("-c", CODE)
    assert ok.returncode == 0 and "(3, 32, 32) False" in ok.stdout, ok.stderr[-2000:]
    # The same import with site's .pth files skipped (site-packages added by hand): the CUDA build fails.
    bare = run("-S", "-c", f"import sys; sys.path.append({sysconfig.get_paths()['purelib']!r})\n" + CODE)
    assert bare.returncode != 0 and "torchvision::nms does not exist" in bare.stderr, bare.stderr[-2000:]


@pytest.mark.skipif(not PTH.exists(), reason="a +cpu torchvision is installed: set-up wrote no hook")
def test_transformers_and_vllm_see_torchvision_s_image_processors():
    code = (
        "import transformers\nfrom transformers.models.gemma3 import image_processing_gemma3\n"
        "import vllm.model_executor.models.gemma3_mm\nprint(transformers.utils.is_torchvision_available())\n"
    )
    out = run("-c", code)
    assert out.returncode == 0 and out.stdout.strip().endswith("True"), out.stderr[-2000:]


@pytest.mark.skipif(not PTH.exists(), reason="a +cpu torchvision is installed: set-up wrote no hook")
def test_the_hook_is_installed_once_and_leaves_the_package_to_sys_path():
    """site reads the .pth once per site directory (twice where the venv's lib64 links to lib): one hook, whose
    definitions stay alive after it has run; and `hidden_states` is not imported at interpreter start, so a
    checkout's own tests import its own code (the editable install's finder would pin another checkout's)."""
    code = (
        "import sys\n"
        "print(sum(type(f).__name__ == '_Hook' for f in sys.meta_path), 'hidden_states' in sys.modules)\n"
        "import torchvision, transformers, gc\ngc.collect()\n"
        "from transformers import LlamaConfig\nprint('ok')\n"
    )
    out = run("-c", code)
    assert out.returncode == 0 and out.stdout.split() == ["1", "False", "ok"], (out.stdout, out.stderr[-2000:])

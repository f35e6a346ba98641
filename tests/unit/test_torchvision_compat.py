"""hidden_states/torchvision_compat.py: PyPI's torchvision imports on the +cpu torch (its Python
transforms run; the C detection ops stay unavailable). Needs a torchvision install: HS_TORCHVISION_DIR
(a folder with the unpacked wheel) until set-up installs it."""

import os
import subprocess
import sys

import pytest

TV = os.environ.get("HS_TORCHVISION_DIR")


@pytest.mark.skipif(not TV, reason="set HS_TORCHVISION_DIR to an unpacked torchvision==0.28.0 wheel")
def test_torchvision_imports_and_resizes_with_the_hook_and_fails_without_it():
    code = ("import torch, hidden_states.torchvision_compat as c\n{hook}"
            "import torchvision\nfrom torchvision.transforms.v2 import functional as F\n"
            "print(tuple(F.resize(torch.rand(3, 64, 48), [32, 32]).shape), torchvision.extension._has_ops())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TV, os.getcwd()])}
    ok = subprocess.run([sys.executable, "-c", code.format(hook="c.install()\n")], env=env, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "(3, 32, 32) False" in ok.stdout, ok.stderr[-2000:]
    bare = subprocess.run([sys.executable, "-c", code.format(hook="")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert bare.returncode != 0 and "torchvision::nms does not exist" in bare.stderr, bare.stderr[-2000:]

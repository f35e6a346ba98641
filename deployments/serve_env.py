"""Ray Serve's cluster-wide switches this server runs with: `make serve` (scripts/serve.sh) and
the benchmark's clusters.

Ray reads them when its processes start, so they belong in the environment of whatever starts
Ray (`serve run`, `ray start`), not in config.yaml. Measured by `make bench`'s former part
`switches` (removed after d58e22b: `git show d58e22b:bench/switches.py`; figures in
docs/benchmarks.md, "Ray Serve's switches"): direct ingress was the one clear win (1.18-1.28x
req/s at concurrency 1, 8 and 32 on the tiny model), so it is on. Serve's proxy still answers
on config.yaml's port; the Router replica also takes HTTP on a port of its own, from
RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT up (the next free one): clients there skip the proxy hop. Handles from other Ray jobs and the
Router's retry on a dead replica do not go through the proxy, so they are unaffected; the
multi-node test (`make test-long`) runs with them. The cluster configs in cluster/ leave them
off: their front door is the proxy's port (cluster/README.md says how to turn them on).

    eval "$(python -m deployments.serve_env)"   # exports each one unless already set
"""

from __future__ import annotations

SERVE_SWITCHES = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8001",  # config.yaml's proxy port is 8000
    # Serve keeps a stopping ingress replica up 30 s for an external load balancer to notice;
    # with none in front, Ctrl-C stops in seconds.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def main() -> None:
    for key, value in SERVE_SWITCHES.items():
        print(f'export {key}="${{{key}:-{value}}}"')


if __name__ == "__main__":
    main()

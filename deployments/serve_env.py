"""Ray Serve's cluster-wide switches this server runs with: `make serve` (scripts/serve.sh) and
the benchmark's clusters.

Ray reads them when its processes start, so they belong in the environment of whatever starts
Ray, not in config.yaml. Direct ingress is on (the one clear win, docs/benchmarks.md "Ray Serve's
switches"): the Router also takes HTTP on a port of its own from
RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT up; the proxy still answers on config.yaml's port.

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

"""The real Serve app on the FakeEngine, in a Ray cluster of its own: the fast tier's server.

    python -m tests.fast.fake_app PORT

Starts a small local Ray (a fresh one, whatever else runs: the serve suite's
cluster lives in the pytest process itself), Serve's proxy on 127.0.0.1:PORT,
and two apps built by `deployments.app.build` with `engine_cls=FakeEngine`:
`fake` (Router -> one EngineReplica) on `/`, and `fake-replica`
(`ingress: replica`) on `/replica`. Prints `READY` (with its start-up time)
once both run, then serves until its stdin closes, and shuts Serve and Ray down.
"""

from __future__ import annotations

import sys
import time

ROUTER_PREFIX, REPLICA_PREFIX = "/", "/replica"

# Each token takes 20 ms (a 400-token request: 8 s, unless cancelled); requests time out after 3 s.
ARGS = {
    "model": "builtin:tiny-llama",
    "engine": {"token_delay_s": 0.02},
    "request_timeout_s": 3,
    "replica_autoscaling": {"min_replicas": 1, "max_replicas": 1},
    "router_autoscaling": {"min_replicas": 1, "max_replicas": 1},
}


def main(port: int) -> None:
    import ray
    from ray import serve

    from deployments.app import build
    from hidden_states.testing import FakeEngine

    t0 = time.monotonic()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", namespace="fake")
    t_ray = time.monotonic()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many(
            [  # both at once; returns once both run (or raises with the cause)
                serve.RunTarget(build(ARGS, engine_cls=FakeEngine), name="fake", route_prefix=ROUTER_PREFIX),
                serve.RunTarget(
                    build({**ARGS, "ingress": "replica"}, engine_cls=FakeEngine),
                    name="fake-replica",
                    route_prefix=REPLICA_PREFIX,
                ),
            ]
        )
        print(
            f"READY in {time.monotonic() - t0:.1f} s (Ray {t_ray - t0:.1f} s, Serve and the apps "
            f"{time.monotonic() - t_ray:.1f} s)",
            flush=True,
        )
        sys.stdin.read()  # until the test closes it (or dies)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""The Serve application: `serve run config.yaml` -> build_app(args).

    request -> Router (HTTP ingress) -> EngineReplica (vLLM + extraction step) -> Router -> response
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs
from deployments.replica import EngineReplica
from deployments.router import Router


def build_app(args: dict | None = None) -> Application:
    cfg = AppArgs.model_validate(args or {})
    plain = cfg.model_dump(mode="json")
    replica = EngineReplica.options(**cfg.replica_options()).bind(plain)
    return Router.options(
        autoscaling_config=cfg.router_autoscaling.model_dump(exclude_none=True),
        ray_actor_options={"num_cpus": 0},
    ).bind(replica, plain)

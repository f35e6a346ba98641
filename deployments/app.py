"""The Serve application: `serve run config.yaml` -> build_app(args).

    request -> Router (HTTP ingress) -> EngineReplica (vLLM + extraction step) -> Router -> response
    request -> EngineReplica (HTTP ingress, vLLM + extraction step) -> response      (`ingress: replica`)

`build(args, engine_cls)` is the same app on another engine (e.g. `hidden_states.testing.FakeEngine`).
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs
from deployments.replica import EngineReplicaDeployment, IngressEngineReplicaDeployment
from deployments.router import Router


def build_app(args: dict | None = None) -> Application:
    return build(args)


def build(args: dict | None = None, engine_cls: type | None = None) -> Application:
    """The app; `engine_cls` None: vLLM's HiddenStatesEngine (imported by the replicas only)."""
    cfg = AppArgs.model_validate(args or {})
    plain = cfg.model_dump(mode="json")
    logging_config = {"enable_access_log": cfg.access_log}
    deployment = IngressEngineReplicaDeployment if cfg.ingress == "replica" else EngineReplicaDeployment
    engine = () if engine_cls is None else (engine_cls,)  # a class travels by reference (module and name)
    replica = deployment.options(**cfg.replica_options(), logging_config=logging_config).bind(plain, *engine)
    if cfg.ingress == "replica":
        return replica
    return Router.options(
        autoscaling_config=cfg.router_autoscaling.model_dump(exclude_none=True),
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": dict(cfg.serve_env)}},
        logging_config=logging_config,
    ).bind(replica, plain)

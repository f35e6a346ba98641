"""The cluster configs under cluster/, checked without starting any cluster.

- gpu-aws.yaml, tpu-gcp.yaml: the path `ray up` takes before it touches a
  cloud (Ray's prepare_config, then validate_config against the autoscaler's
  ray-schema.json shipped in the ray package), plus the pool's shape.
- rayservice.yaml: the fields KubeRay needs, and its serveConfigV2 through Ray
  Serve's own pydantic schema and the app's own argument model.
- All of them: the Ray pyproject.toml pins (and the venv has), a Python the
  project supports, and the app named as config.yaml names it.

Every validator is also shown a deliberately broken copy and must reject it,
so a validator that accepts anything fails here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pydantic
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
REPO = CLUSTER.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
IMPORT_PATH = "deployments.app:build_app"
SCHEMA_PATH = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"


def load(name: str):
    return yaml.safe_load((CLUSTER / name).read_text())


def ray_up_check(config: dict) -> dict:
    """What `ray up` does to a config before any cloud call (commands._bootstrap_config)."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def rejected(fn, *args) -> bool:
    try:
        fn(*args)
    except (jsonschema.ValidationError, ValueError, AssertionError, KeyError, TypeError):
        return True
    return False


# --------------------------------------------------------------------------
# Cluster launcher configs
# --------------------------------------------------------------------------

LAUNCHER_CONFIGS = ["gpu-aws.yaml", "gpu-aws-multinode.yaml", "tpu-gcp.yaml"]
# Each GPU pool and the Serve config deployed on it.
GPU_POOLS = {"gpu-aws.yaml": "serve-gpu.yaml", "gpu-aws-multinode.yaml": "serve-gpu-multinode.yaml"}
SERVE_CONFIGS = ["serve-gpu.yaml", "serve-gpu-multinode.yaml"]


def test_schema_is_rays_own():
    schema = json.loads(SCHEMA_PATH.read_text())
    assert {"cluster_name", "provider"} <= set(schema["required"])
    assert "available_node_types" in schema["properties"]


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_passes_ray_validation(name):
    raw = load(name)
    # The file itself, before Ray merges its defaults in, is schema-valid...
    jsonschema.validate(raw, json.loads(SCHEMA_PATH.read_text()))
    # ...and so is what `ray up` would build from it.
    prepared = ray_up_check(raw)
    assert prepared["head_node_type"] in prepared["available_node_types"]
    assert set(prepared["available_node_types"]) == set(raw["available_node_types"]), (
        "Ray's default node types leaked in"
    )


def _drop(cfg, *path):
    node = cfg
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return cfg


def _set(cfg, value, *path):
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda c: _set(c, 4, "max_worker"), id="misspelt-top-level-key"),
        pytest.param(lambda c: _drop(c, "provider"), id="no-provider"),
        pytest.param(lambda c: _set(c, "4", "max_workers"), id="max-workers-string"),
        pytest.param(lambda c: _set(c, "nowhere", "head_node_type"), id="unknown-head-type"),
        pytest.param(
            lambda c: _drop(c, "available_node_types", c["head_node_type"], "node_config"),
            id="head-without-node-config",
        ),
        pytest.param(
            lambda c: [
                _set(c, {"GPU": "1"}, "available_node_types", t, "resources") for t in c["available_node_types"]
            ][0],
            id="resource-count-string",
        ),
        pytest.param(
            lambda c: [_set(c, 99, "available_node_types", t, "min_workers") for t in c["available_node_types"]][0],
            id="min-workers-above-max",
        ),
        pytest.param(lambda c: _set(c, "ray start --head", "head_start_ray_commands"), id="commands-not-a-list"),
    ],
)
def test_launcher_validation_rejects_broken_copy(name, breakage):
    broken = copy.deepcopy(load(name))
    breakage(broken)
    assert rejected(ray_up_check, broken)


def _worker_types(cfg: dict) -> dict:
    return {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}


def gpu_pool_errors(cfg: dict, serve_cfg: dict) -> list[str]:
    errors = []
    head = cfg["available_node_types"][cfg["head_node_type"]]
    if head["resources"].get("GPU", 0):
        errors.append("head should be a CPU node")
    gpu_types = {k: v for k, v in _worker_types(cfg).items() if v["resources"].get("GPU", 0) >= 1}
    if not gpu_types:
        errors.append("no GPU worker type")
    for name, t in gpu_types.items():
        if t.get("min_workers", 0) != 0:
            errors.append(f"{name}: min_workers should be 0 (scale from zero)")
        if not t.get("max_workers"):
            errors.append(f"{name}: max_workers not set")
    if cfg.get("max_workers", 0) < 1:
        errors.append("global max_workers < 1")
    install = " ".join(cfg.get("setup_commands", []))
    if "pip install -e '.[gpu]'" not in install:
        errors.append("setup_commands do not install the project with its gpu extra")
    if "git clone" not in install:
        errors.append("setup_commands do not clone the project")
    if not cfg.get("docker", {}).get("image"):
        errors.append("no docker image")
    if not any("--head" in c for c in cfg.get("head_start_ray_commands", [])):
        errors.append("head_start_ray_commands do not start a head")
    if not any("$RAY_HEAD_IP" in c for c in cfg.get("worker_start_ray_commands", [])):
        errors.append("worker_start_ray_commands do not join the head")
    # Capacity: each pipeline stage's tensor_parallel_size GPUs on one node (vLLM's Ray executor places a stage's
    # ranks together), all replicas' stages together in the pool.
    app = serve_cfg["applications"][0]
    tp, pp = _parallelism(serve_cfg)
    max_replicas = max(d["autoscaling_config"]["max_replicas"] for d in app["deployments"] if "autoscaling_config" in d)
    per_node = max((t["resources"]["GPU"] for t in gpu_types.values()), default=0)
    if tp > per_node:
        errors.append(f"tensor_parallel_size {tp} > {per_node} GPUs per node")
    nodes = sum(t.get("max_workers", 0) for t in gpu_types.values())
    if per_node and min(nodes, cfg.get("max_workers", 0)) * (per_node // tp) < max_replicas * pp:
        errors.append(f"the pool cannot hold max_replicas={max_replicas} replicas of {tp} x {pp} GPU(s)")
    return errors


def _parallelism(serve_cfg: dict) -> tuple[int, int]:
    engine = serve_cfg["applications"][0]["args"]["engine"]
    return int(engine.get("tensor_parallel_size", 1)), int(engine.get("pipeline_parallel_size", 1))


@pytest.mark.parametrize("pool", sorted(GPU_POOLS))
def test_gpu_pool_shape(pool):
    cfg, serve_cfg = load(pool), load(GPU_POOLS[pool])
    assert cfg["provider"]["type"] == "aws"
    assert gpu_pool_errors(cfg, serve_cfg) == []
    # The same check on broken copies.
    no_gpu = copy.deepcopy(cfg)
    for t in _worker_types(no_gpu).values():
        t["resources"]["GPU"] = 0
    assert gpu_pool_errors(no_gpu, serve_cfg)
    too_small = copy.deepcopy(cfg)
    too_small["max_workers"] = 1
    assert gpu_pool_errors(too_small, serve_cfg)
    tp_over = copy.deepcopy(serve_cfg)
    tp_over["applications"][0]["args"]["engine"]["tensor_parallel_size"] = (
        2 * _worker_types(cfg)["gpu_worker"]["resources"]["GPU"]
    )
    assert any("tensor_parallel_size" in e for e in gpu_pool_errors(cfg, tp_over))
    more_stages = copy.deepcopy(serve_cfg)
    more_stages["applications"][0]["args"]["engine"]["pipeline_parallel_size"] = 2 * _parallelism(serve_cfg)[1] + 4
    assert any("cannot hold" in e for e in gpu_pool_errors(cfg, more_stages))
    no_install = copy.deepcopy(cfg)
    no_install["setup_commands"] = [c for c in cfg["setup_commands"] if "pip install" not in c]
    assert gpu_pool_errors(no_install, serve_cfg)


def tpu_pool_errors(cfg: dict) -> list[str]:
    """Ray's own TPU rules (ray._private.accelerators.tpu), the ones its GCP provider applies."""
    from ray._private.accelerators import TPUAcceleratorManager, tpu

    errors = []
    tpu_types = {k: v for k, v in _worker_types(cfg).items() if "acceleratorType" in v["node_config"]}
    if not tpu_types:
        errors.append("no TPU worker type")
    for name, t in tpu_types.items():
        nc = t["node_config"]
        acc = nc["acceleratorType"]
        if "machineType" in nc:
            errors.append(f"{name}: a TPU node has no machineType")
        if not nc.get("runtimeVersion"):
            errors.append(f"{name}: runtimeVersion missing")
        if not TPUAcceleratorManager.is_valid_tpu_accelerator_type(acc):
            errors.append(f"{name}: invalid acceleratorType {acc!r}")
            continue
        chips = int(acc.split("-")[1]) // tpu.get_tpu_cores_per_chip(acc)
        if chips > tpu.get_num_tpu_visible_chips_per_host(acc):
            errors.append(f"{name}: {acc} is a multi-host pod; the autoscaler cannot scale it")
        if t["resources"].get("TPU") != chips:
            errors.append(f"{name}: resources.TPU {t['resources'].get('TPU')} != {chips} chips of {acc}")
        if t.get("min_workers", 0) != 0:
            errors.append(f"{name}: min_workers should be 0")
    head = cfg["available_node_types"][cfg["head_node_type"]]
    if "machineType" not in head["node_config"]:
        errors.append("head should be a Compute instance")
    return errors


def test_tpu_pool_shape_and_experimental_mark():
    text = (CLUSTER / "tpu-gcp.yaml").read_text()
    assert text.splitlines()[0].startswith("# EXPERIMENTAL"), (
        "tpu-gcp.yaml must say it is experimental on its first line"
    )
    assert "NOT run" in text.splitlines()[0]
    cfg = yaml.safe_load(text)
    assert cfg["provider"]["type"] == "gcp"
    assert tpu_pool_errors(cfg) == []
    for breakage in (
        lambda t: t["node_config"].update(acceleratorType="v5e8"),
        lambda t: t["node_config"].update(acceleratorType="v5litepod-64"),  # multi-host
        lambda t: t["resources"].update(TPU=4),
        lambda t: t["node_config"].update(machineType="n2-standard-8"),
        lambda t: t["node_config"].pop("runtimeVersion"),
    ):
        broken = copy.deepcopy(cfg)
        for t in _worker_types(broken).values():
            breakage(t)
        assert tpu_pool_errors(broken), breakage


# --------------------------------------------------------------------------
# KubeRay RayService
# --------------------------------------------------------------------------

DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _containers(template: dict) -> list:
    return (template or {}).get("spec", {}).get("containers") or []


def rayservice_errors(doc: dict) -> list[str]:
    """The fields the KubeRay operator (ray.io/v1) needs to create the service."""
    errors = []
    if doc.get("apiVersion") != "ray.io/v1":
        errors.append(f"apiVersion {doc.get('apiVersion')!r} != 'ray.io/v1'")
    if doc.get("kind") != "RayService":
        errors.append("kind is not RayService")
    name = (doc.get("metadata") or {}).get("name")
    if not name or not DNS1123.match(name):
        errors.append(f"metadata.name {name!r} is not a DNS-1123 label")
    spec = doc.get("spec") or {}
    scv2 = spec.get("serveConfigV2")
    if not isinstance(scv2, str):
        errors.append("spec.serveConfigV2 must be a YAML string")
    else:
        try:
            serve_cfg = yaml.safe_load(scv2)
            if serve_cfg["applications"][0]["import_path"] != IMPORT_PATH:
                errors.append(f"applications[0].import_path != {IMPORT_PATH!r}")
        except Exception as e:  # noqa: BLE001 - any parse/shape problem is a finding
            errors.append(f"serveConfigV2 does not parse to a Serve config: {e!r}")
    rcc = spec.get("rayClusterConfig") or {}
    if rcc.get("enableInTreeAutoscaling") is not True:
        errors.append("rayClusterConfig.enableInTreeAutoscaling must be true")
    if not isinstance(rcc.get("rayVersion"), str):
        errors.append("rayClusterConfig.rayVersion must be a string")
    head = rcc.get("headGroupSpec") or {}
    groups = [("head", head)] + [(g.get("groupName", "?"), g) for g in rcc.get("workerGroupSpecs") or []]
    for gname, g in groups:
        containers = _containers(g.get("template"))
        if not containers:
            errors.append(f"{gname}: template.spec.containers is empty")
        for c in containers:
            if not c.get("name") or not c.get("image"):
                errors.append(f"{gname}: every container needs a name and an image")
        for k, v in (g.get("rayStartParams") or {}).items():
            if not isinstance(v, str):  # the CRD types rayStartParams as map[string]string
                errors.append(f"{gname}: rayStartParams.{k} must be a string, got {v!r}")
    workers = rcc.get("workerGroupSpecs") or []
    if not workers:
        errors.append("no workerGroupSpecs")
    names = [g.get("groupName") for g in workers]
    if len(set(names)) != len(names):
        errors.append("groupName values must be unique")
    for g in workers:
        gname = g.get("groupName")
        if not gname or not DNS1123.match(gname):
            errors.append(f"worker group name {gname!r} is not a DNS-1123 label")
        lo, hi = g.get("minReplicas"), g.get("maxReplicas")
        if not isinstance(lo, int) or not isinstance(hi, int) or not 0 <= lo <= hi:
            errors.append(f"{gname}: need integers 0 <= minReplicas <= maxReplicas, got {lo}, {hi}")
        elif "replicas" in g and not lo <= g["replicas"] <= hi:
            errors.append(f"{gname}: replicas outside [minReplicas, maxReplicas]")
    gpu_groups = [g for g in workers if _gpus(g)]
    if not gpu_groups:
        errors.append("no worker group requests nvidia.com/gpu")
    for g in gpu_groups:
        num_gpus = (g.get("rayStartParams") or {}).get("num-gpus")
        if num_gpus is None or int(num_gpus) != _gpus(g):
            errors.append(
                f"{g.get('groupName')}: rayStartParams.num-gpus {num_gpus!r} != nvidia.com/gpu limit {_gpus(g)}"
            )
    return errors


def _gpus(group: dict) -> int:
    total = 0
    for c in _containers(group.get("template")):
        limit = ((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
        total += int(limit or 0)
    return total


def test_rayservice_has_what_kuberay_needs():
    assert rayservice_errors(load("rayservice.yaml")) == []


def _gpu_group(doc):
    return next(g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"] if _gpus(g))


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda d: d.update(apiVersion="ray.io/v1alpha1"), id="old-api-version"),
        pytest.param(lambda d: d.update(kind="RayCluster"), id="wrong-kind"),
        pytest.param(lambda d: d["metadata"].update(name="Hidden_States"), id="bad-name"),
        pytest.param(
            lambda d: d["spec"].update(serveConfigV2=yaml.safe_load(d["spec"]["serveConfigV2"])),
            id="serve-config-not-string",
        ),
        pytest.param(
            lambda d: d["spec"].update(serveConfigV2=d["spec"]["serveConfigV2"].replace(IMPORT_PATH, "app:main")),
            id="wrong-import-path",
        ),
        pytest.param(lambda d: d["spec"].update(serveConfigV2="applications: ["), id="serve-config-not-yaml"),
        pytest.param(
            lambda d: d["spec"]["rayClusterConfig"].update(enableInTreeAutoscaling=False), id="no-autoscaling"
        ),
        pytest.param(
            lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"].update(containers=[]),
            id="head-no-container",
        ),
        pytest.param(
            lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("image"),
            id="head-no-image",
        ),
        pytest.param(lambda d: _gpu_group(d).update(minReplicas=5, maxReplicas=2), id="min-above-max"),
        pytest.param(lambda d: _gpu_group(d).pop("groupName"), id="no-group-name"),
        pytest.param(lambda d: _gpu_group(d)["template"]["spec"].update(containers=[]), id="worker-no-container"),
        pytest.param(
            lambda d: _gpu_group(d)["template"]["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu"),
            id="no-gpu-request",
        ),
        pytest.param(lambda d: _gpu_group(d)["rayStartParams"].update({"num-gpus": 1}), id="start-param-not-string"),
        pytest.param(lambda d: _gpu_group(d)["rayStartParams"].update({"num-gpus": "2"}), id="num-gpus-mismatch"),
    ],
)
def test_rayservice_check_rejects_broken_copy(breakage):
    broken = copy.deepcopy(load("rayservice.yaml"))
    breakage(broken)
    assert rayservice_errors(broken)


# --------------------------------------------------------------------------
# The Serve config (serveConfigV2 == cluster/serve-gpu.yaml)
# --------------------------------------------------------------------------


def embedded_serve_config() -> dict:
    return yaml.safe_load(load("rayservice.yaml")["spec"]["serveConfigV2"])


def serve_schema_check(cfg: dict):
    """Ray Serve's own schema, plus what it silently ignores (unknown keys)."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

    parsed = ServeDeploySchema.model_validate(cfg)
    assert parsed.applications, "no applications"
    for app_raw in cfg["applications"]:
        unknown = set(app_raw) - set(ServeApplicationSchema.model_fields)
        assert not unknown, f"unknown application fields {unknown}"
        for dep in app_raw.get("deployments", []):
            unknown = set(dep) - set(DeploymentSchema.model_fields)
            assert not unknown, f"unknown deployment fields {unknown}"
            if "autoscaling_config" in dep:
                unknown = set(dep["autoscaling_config"]) - set(AutoscalingConfig.model_fields)
                assert not unknown, f"unknown autoscaling fields {unknown}"
                AutoscalingConfig(**dep["autoscaling_config"])  # min <= initial <= max etc.
    return parsed


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_is_valid_for_ray_serve(name):
    parsed = serve_schema_check(load(name))
    app = parsed.applications[0]
    assert app.import_path == IMPORT_PATH
    assert app.args["enable_return_hidden_states"] is True
    assert app.args["engine"]["tensor_parallel_size"] >= 1
    scaled = [d for d in app.deployments if d.autoscaling_config]
    assert scaled, "no deployment has an autoscaling_config"
    for d in scaled:
        ac = d.autoscaling_config
        assert ac["min_replicas"] >= 1 and ac["max_replicas"] > ac["min_replicas"]
        assert ac["target_ongoing_requests"] > 0


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda a: a.update(import_path="deploymentsapp"), id="import-path-without-separator"),
        pytest.param(
            lambda a: a["deployments"][0]["autoscaling_config"].update(min_replicas=5, max_replicas=2),
            id="min-above-max",
        ),
        pytest.param(
            lambda a: a["deployments"][0]["autoscaling_config"].update(target_ongoing_requests=-1), id="negative-target"
        ),
        pytest.param(lambda a: a["deployments"][0].update(autoscaling_confg={}), id="misspelt-deployment-field"),
        pytest.param(
            lambda a: a["deployments"][0]["autoscaling_config"].update(max_replica=8), id="misspelt-autoscaling-field"
        ),
        pytest.param(lambda a: a["deployments"][0].pop("name"), id="deployment-without-name"),
        pytest.param(lambda a: a.update(args="model=x"), id="args-not-a-mapping"),
    ],
)
def test_serve_schema_rejects_broken_copy(breakage):
    broken = copy.deepcopy(embedded_serve_config())
    breakage(broken["applications"][0])
    with pytest.raises(Exception) as e:  # pydantic.ValidationError or our AssertionError
        serve_schema_check(broken)
    assert e.type.__name__ in ("ValidationError", "AssertionError", "ValueError"), e.type


def test_rayservice_embeds_the_serve_gpu_config():
    assert embedded_serve_config() == load("serve-gpu.yaml")


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_app_args_match_the_apps_own_model(name):
    """The args go through deployments.config.AppArgs (extra=forbid) as build_app will, and the engine's
    arguments past the refusals the engine applies at start (hidden_states/vllm/engine_args.py)."""
    from deployments.config import AppArgs
    from hidden_states.vllm import engine_args

    args = load(name)["applications"][0]["args"]
    parsed = AppArgs.model_validate(args)
    assert parsed.resolved_accelerator() == "gpu"
    engine_args.refuse(parsed.engine_args())
    opts = parsed.replica_options()
    tp = args["engine"]["tensor_parallel_size"] * args["engine"].get("pipeline_parallel_size", 1)
    gpus = opts["ray_actor_options"].get("num_gpus", 0) + sum(
        b.get("GPU", 0) for b in opts.get("placement_group_bundles", [])
    )
    assert gpus == tp, opts
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate(args | {"enigne": {}})
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate(args | {"accelerator": "tpu"})


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_engine_args_are_vllm_engine_arguments(name):
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    engine = load(name)["applications"][0]["args"]["engine"]
    assert set(engine) <= known, set(engine) - known
    assert "tensor_paralel_size" not in known  # the check can fail


def test_gpu_capacity_fits_serve_max_replicas():
    """Pods (RayService) and nodes (gpu-aws.yaml) can hold max_replicas x tensor_parallel_size GPUs."""
    serve_cfg = embedded_serve_config()
    app = serve_cfg["applications"][0]
    tp = app["args"]["engine"]["tensor_parallel_size"]
    max_replicas = max(d["autoscaling_config"]["max_replicas"] for d in app["deployments"])
    g = _gpu_group(load("rayservice.yaml"))
    assert _gpus(g) >= tp, "a replica's GPUs must fit in one pod"
    assert g["maxReplicas"] * (_gpus(g) // tp) >= max_replicas
    for pool, serve in GPU_POOLS.items():
        assert gpu_pool_errors(load(pool), load(serve)) == [], pool


def _first(rx: str, text: str) -> str | None:
    m = re.search(rx, text, re.M)
    return m.group(1) if m else None


def pinned_ray() -> str | None:
    """The version pyproject.toml pins Ray to (`ray[...]==X`): the one Ray the project runs."""
    pins = [v for d in PROJECT["dependencies"] if (v := _first(r"^ray(?:\[[\w,]+\])?==([\w.]+)$", d.replace(" ", "")))]
    return pins[0] if len(pins) == 1 else None


def cluster_ray_versions() -> dict[str, str | None]:
    """The Ray each cluster file runs."""
    return {
        "rayservice.yaml rayVersion": load("rayservice.yaml")["spec"]["rayClusterConfig"]["rayVersion"],
        **{
            f"{pool} docker.image": _first(r"^rayproject/ray:([\w.]+)-py3\d+-gpu$", load(pool)["docker"]["image"])
            for pool in GPU_POOLS
        },
        "Dockerfile FROM": _first(r"^FROM rayproject/ray:([\w.]+)-py3\d+-gpu$", (CLUSTER / "Dockerfile").read_text()),
        "tpu-gcp.yaml setup_commands": _first(
            r'"ray\[[\w,]+\]==([\w.]+)"', " ".join(load("tpu-gcp.yaml")["setup_commands"])
        ),
    }


def test_ray_is_one_version_everywhere():
    """pyproject.toml pins Ray exactly, every cluster file runs that Ray (`ray up` needs the same Ray
    on both sides) and so does this venv: a newer Ray on the registry changes none of them."""
    pin = pinned_ray()
    assert pin, "pyproject.toml must pin Ray exactly once: ray[...]==X"
    assert {k: v for k, v in cluster_ray_versions().items() if v != pin} == {}, f"pyproject.toml pins ray {pin}"
    assert ray.__version__ == pin, f"installed ray {ray.__version__} != pyproject's {pin}: run scripts/setup.sh"


def test_cluster_pythons_are_ones_the_project_supports():
    """The images' Python (pyNNN in the tag) and the TPU nodes' venv within requires-python."""
    lo, hi = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", PROJECT["requires-python"]).groups()
    minors = {
        "Dockerfile": _first(r"^FROM rayproject/ray:[\w.]+-py3(\d+)-", (CLUSTER / "Dockerfile").read_text()),
        **{pool: _first(r"-py3(\d+)-", load(pool)["docker"]["image"]) for pool in GPU_POOLS},
        "tpu-gcp.yaml": _first(r"uv venv --python 3\.(\d+)", " ".join(load("tpu-gcp.yaml")["setup_commands"])),
    }
    assert {k: v for k, v in minors.items() if v is None or not int(lo) <= int(v) < int(hi)} == {}


def test_every_serve_config_names_the_app_as_config_yaml():
    """Handles find the app by its name (README.md: `serve.get_app_handle(...)`): one name in every
    shipped Serve config, the README's example included."""
    (want,) = [a["name"] for a in yaml.safe_load((REPO / "config.yaml").read_text())["applications"]]
    names = {
        **{f"cluster/{n}": [a["name"] for a in load(n)["applications"]] for n in SERVE_CONFIGS},
        "cluster/rayservice.yaml serveConfigV2": [a["name"] for a in embedded_serve_config()["applications"]],
        "README.md get_app_handle": re.findall(r'get_app_handle\("([^"]+)"\)', (REPO / "README.md").read_text()),
    }
    assert {k: v for k, v in names.items() if set(v) - {want}} == {}, f"config.yaml names its app {want!r}"


# --------------------------------------------------------------------------
# All files: placeholders, not secrets or machine paths
# --------------------------------------------------------------------------

FORBIDDEN = [
    (re.compile(r"AKIA[0-9A-Z]{16}"), "AWS access key id"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "private key"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "Hugging Face token"),
    (re.compile(r"ssh_private_key\s*:"), "ssh key path"),
    (re.compile(r"(?<![\w.~])/(?:work|Users|root|tmp)/"), "a machine path"),
    (re.compile(r"/home/(?!ray/)[a-z]"), "a machine path"),
    (re.compile(r"\b\d{12}\b"), "an account id"),
]


def leaks(text: str) -> list[str]:
    return [what for rx, what in FORBIDDEN if rx.search(text)]


@pytest.mark.parametrize("name", sorted(p.name for p in CLUSTER.iterdir() if p.is_file()))
def test_no_secrets_or_machine_paths(name):
    text = (CLUSTER / name).read_text()
    assert leaks(text) == []
    # Files with site-specific values mark them YOUR_...; these have none (the dashboard picks
    # its Prometheus data source when imported).
    site_free = ("README.md", *SERVE_CONFIGS, "grafana-dashboard.json")
    assert "YOUR_" in text or name in site_free, "placeholders should be marked YOUR_..."


def test_leak_check_can_fail():
    for bad in (
        "key: AKIAABCDEFGHIJKLMNOP",
        "token: hf_abcdefghijklmnopqrstuvwxyz",
        "ssh_private_key: ~/.ssh/id",
        "path: /work/main/x",
        "account: 123456789012",
    ):
        assert leaks(bad), bad


# --------------------------------------------------------------------------
# The Serve config against the app itself (what the Serve controller does)
# --------------------------------------------------------------------------


def effective_deployments(serve_cfg: dict, monkeypatch) -> dict:
    """Build the app from the config's args and apply the config's deployment
    overrides with Serve's own controller code; no Ray instance is started."""
    from types import SimpleNamespace

    from ray.serve._private import deploy_utils
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app as serve_build_app
    from ray.serve.schema import ServeDeploySchema

    # get_deploy_args only asks Ray for the deployer's job id.
    monkeypatch.setattr(
        deploy_utils.ray, "get_runtime_context", lambda: SimpleNamespace(get_job_id=lambda: "cluster-config-test")
    )
    app_cfg = ServeDeploySchema.model_validate(serve_cfg).applications[0]
    module, attr = app_cfg.import_path.split(":")
    builder = getattr(__import__(module, fromlist=[attr]), attr)
    built = serve_build_app(call_user_app_builder_with_args_if_necessary(builder, app_cfg.args), name=app_cfg.name)
    infos = {}
    for d in built.deployments:
        ingress = d.name == built.ingress_deployment_name
        params = deploy_utils.get_deploy_args(
            name=d.name,
            replica_config=d._replica_config,
            ingress=ingress,
            deployment_config=d._deployment_config,
            route_prefix=app_cfg.route_prefix if ingress else None,
        )
        infos[d.name] = deploy_utils.deploy_args_to_deployment_info(**params, app_name=app_cfg.name)
    return override_deployment_info(infos, app_cfg)


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_config_overrides_apply_to_the_apps_deployments(monkeypatch, name):
    serve_cfg = load(name)
    app = serve_cfg["applications"][0]
    infos = effective_deployments(serve_cfg, monkeypatch)
    for dep in app["deployments"]:
        got = infos[dep["name"]].deployment_config.autoscaling_config
        assert (got.min_replicas, got.max_replicas) == (
            dep["autoscaling_config"]["min_replicas"],
            dep["autoscaling_config"]["max_replicas"],
        )
    # The engine replica asks for tensor_parallel_size x pipeline_parallel_size GPUs; nothing else does.
    tp = app["args"]["engine"]["tensor_parallel_size"] * app["args"]["engine"].get("pipeline_parallel_size", 1)
    gpu_deps = {
        n: i
        for n, i in infos.items()
        if i.replica_config.ray_actor_options.get("num_gpus")
        or any(b.get("GPU") for b in i.replica_config.placement_group_bundles or [])
    }
    assert len(gpu_deps) == 1, list(gpu_deps)
    (info,) = gpu_deps.values()
    assert (
        info.replica_config.ray_actor_options.get("num_gpus", 0)
        + sum(b.get("GPU", 0) for b in info.replica_config.placement_group_bundles or [])
        == tp
    )
    # A config naming a deployment the app does not have is refused by the same code.
    broken = copy.deepcopy(serve_cfg)
    broken["applications"][0]["deployments"][0]["name"] = "NoSuchDeployment"
    with pytest.raises(ValueError, match="does not exist"):
        effective_deployments(broken, monkeypatch)


def test_tensor_parallel_replicas_get_a_packed_placement_group(monkeypatch):
    serve_cfg = embedded_serve_config()
    serve_cfg["applications"][0]["args"]["engine"]["tensor_parallel_size"] = 2
    infos = effective_deployments(serve_cfg, monkeypatch)
    rc = next(i.replica_config for i in infos.values() if i.replica_config.placement_group_bundles)
    assert sum(b.get("GPU", 0) for b in rc.placement_group_bundles) == 2
    assert rc.placement_group_strategy == "STRICT_PACK"
    assert not rc.ray_actor_options.get("num_gpus")
    # ...which is why the pool's nodes must each hold tensor_parallel_size GPUs.
    assert any("tensor_parallel_size" in e for e in gpu_pool_errors(load("gpu-aws.yaml"), serve_cfg))


def test_a_replica_across_nodes_gets_one_gpu_bundle_per_rank_packed_not_strictly(monkeypatch):
    """serve-gpu-multinode.yaml: 8 x 2 ranks as 16 {GPU: 1} bundles after the replica's {CPU: 1}, PACK (STRICT_PACK
    would need one node of 16 GPUs, which the pool has not), as Ray Serve LLM places multi-node engines."""
    serve_cfg = load("serve-gpu-multinode.yaml")
    infos = effective_deployments(serve_cfg, monkeypatch)
    rc = next(i.replica_config for i in infos.values() if i.replica_config.placement_group_bundles)
    assert rc.placement_group_bundles == [{"CPU": 1}] + [{"GPU": 1}] * 16
    assert rc.placement_group_strategy == "PACK"
    # ...and with one stage the same GPUs must share a node, so the pool's 8-GPU nodes could not hold it.
    one_stage = copy.deepcopy(serve_cfg)
    one_stage["applications"][0]["args"]["engine"] |= {"tensor_parallel_size": 16, "pipeline_parallel_size": 1}
    rc1 = next(
        i.replica_config
        for i in effective_deployments(one_stage, monkeypatch).values()
        if i.replica_config.placement_group_bundles
    )
    assert rc1.placement_group_strategy == "STRICT_PACK"
    assert any("tensor_parallel_size" in e for e in gpu_pool_errors(load("gpu-aws-multinode.yaml"), one_stage))

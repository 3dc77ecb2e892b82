"""deploy/kubernetes/: the RayService validated against KubeRay's CRD schema (made strict: an unknown or
misspelt field fails, where the API server would silently drop it), its embedded Serve config kept in
step with deploy/serve_config*.yaml, the cluster sized for it, and the PodMonitor scraping its pods.

The CRD (tests/deploy/data/kuberay/, Apache-2.0, LICENSE and source beside it) is KubeRay's
ray.io_rayservices.yaml, copied unchanged."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml

from service.app import ingress_grace_s
from tests.deploy.serve_configs import CPU_CONFIG, GPU_CONFIG, check_serve_config, load, our_app, settings_of

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
CRD = Path(__file__).resolve().parent / "data" / "kuberay" / "ray.io_rayservices.yaml"
GPU = "nvidia.com/gpu"


def strict(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties (and
    does not say otherwise): Kubernetes prunes unknown fields, so a typo would pass unnoticed."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k != "properties" else {p: strict(s) for p, s in v.items()}
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft4Validator:
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1 MB
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    return yaml.safe_load((K8S / "rayservice.yaml").read_text())


def _errors(validator: jsonschema.Draft4Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _groups(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def _container(group: dict[str, Any]) -> dict[str, Any]:
    (container,) = group["template"]["spec"]["containers"]
    return container


def _quantity(value: Any) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Gi|Mi)?", str(value))
    assert m, f"unexpected quantity {value!r}"
    return float(m.group(1)) * {None: 1, "m": 1e-3, "Gi": 1, "Mi": 1 / 1024}[m.group(2)]


def test_rayservice_is_valid_against_kuberays_crd(validator: jsonschema.Draft4Validator,
                                                  service: dict[str, Any]) -> None:
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    assert _errors(validator, service) == []


@pytest.mark.parametrize(("path", "key", "value", "match"), [
    (("spec", "rayClusterConfig"), "enableInTreeAutoscalng", True, "enableInTreeAutoscalng"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers", 0),
     "readinesProbe", {"httpGet": {"path": "/readyz", "port": 8000}}, "readinesProbe"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 1), "maxReplicas", "two", "'two' is not of type"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 1, "template", "spec", "containers", 0, "resources"),
     "limits", {"cpu": "four"}, "does not match"),
])
def test_the_strict_schema_catches_typos(validator: jsonschema.Draft4Validator, service: dict[str, Any],
                                         path: tuple[Any, ...], key: str, value: Any, match: str) -> None:
    broken = copy.deepcopy(service)
    node = broken
    for part in path:
        node = node[part]
    node[key] = value
    errors = _errors(validator, broken)
    assert errors and any(match in e for e in errors), errors


def test_head_cpu_and_gpu_groups_with_the_ray_autoscaler(service: dict[str, Any]) -> None:
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    options = cluster["autoscalerOptions"]
    assert options["upscalingMode"] and options["idleTimeoutSeconds"] > 0
    assert cluster["rayVersion"] == ray.__version__  # the version pinned in constraints.txt, so in the image
    groups = _groups(service)
    assert set(groups) == {"head", "cpu", "gpu"}
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"  # replicas go to the workers
    for name in ("cpu", "gpu"):
        g = groups[name]
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], name
    gpu_pod = groups["gpu"]["template"]["spec"]
    gpu_resources = _container(groups["gpu"])["resources"]
    assert gpu_resources["limits"][GPU] == gpu_resources["requests"][GPU] == 1
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in gpu_pod["tolerations"]
    assert gpu_pod["nodeSelector"]
    for name in ("head", "cpu"):
        assert GPU not in _container(groups[name])["resources"]["limits"] and "tolerations" not in \
               groups[name]["template"]["spec"]
    for name, g in groups.items():
        c = _container(g)
        assert c["resources"]["requests"] == c["resources"]["limits"], name  # Guaranteed QoS
        assert c["image"].endswith("-cuda" if name == "gpu" else "-cpu"), name  # deploy/Dockerfile's VARIANT
        assert g["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_workers_are_ready_through_readyz_on_the_serve_port(service: dict[str, Any]) -> None:
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    port = serve_config["http_options"]["port"]
    for name, g in _groups(service).items():
        c = _container(g)
        assert {"name": "serve", "containerPort": port} in c["ports"], name
        if name == "head":  # KubeRay deploys the Serve config once the head is Ready: keep its own probe
            assert "readinessProbe" not in c
            continue
        probe = c["readinessProbe"]
        assert probe["httpGet"] == {"path": "/readyz", "port": port}
        assert probe["periodSeconds"] <= 10 and probe["failureThreshold"] >= 2


def test_embedded_serve_config_matches_the_serve_config_files(service: dict[str, Any]) -> None:
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert check_serve_config(embedded) == []
    cpu, gpu = load(CPU_CONFIG), load(GPU_CONFIG)
    assert {k: v for k, v in embedded.items() if k != "applications"} == \
           {k: v for k, v in cpu.items() if k != "applications"}
    app, cpu_app, gpu_app = our_app(embedded), our_app(cpu), our_app(gpu)
    assert {k: v for k, v in app.items() if k != "args"} == {k: v for k, v in cpu_app.items() if k != "args"}
    cluster_only = ("device", "dtype", "deployments", "ingress", "metrics_dir")
    assert {k: v for k, v in app["args"].items() if k not in cluster_only} == \
           {k: v for k, v in cpu_app["args"].items() if k not in cluster_only}
    ingress, cpu_ingress = app["args"]["ingress"], cpu_app["args"]["ingress"]
    assert {k: v for k, v in ingress.items() if k not in ("num_replicas", "max_replicas_per_node")} == \
           {k: v for k, v in cpu_ingress.items() if k != "num_replicas"}
    placement = ("device", "dtype")
    for name, dep in app["args"]["deployments"].items():
        mine = {k: v for k, v in dep.items() if k not in placement}
        variants = {"cpu": cpu_app["args"]["deployments"][name], "gpu": gpu_app["args"]["deployments"][name]}
        matches = [v for v, d in variants.items()
                   if {k: x for k, x in d.items() if k not in placement} == mine]
        assert matches, f"deployment {name!r} matches neither serve_config.yaml nor serve_config.gpu.yaml"
    s, on_cpu = settings_of(embedded), settings_of(cpu)
    for name, dep in s.deployments.items():  # a GPU for the GPU deployments, none for the rest (its CPU dtype)
        device, dtype = s.device_for(dep)
        cpu_dtype = on_cpu.device_for(on_cpu.deployments[name])[1]
        assert (device, dtype) == (("cuda", "bfloat16") if dep.num_gpus else ("cpu", cpu_dtype)), name


def test_every_node_of_the_minimum_cluster_has_an_ingress_for_its_metrics(service: dict[str, Any]) -> None:
    s = settings_of(yaml.safe_load(service["spec"]["serveConfigV2"]))
    nodes = sum(g.get("minReplicas", 1) for g in _groups(service).values())
    assert (s.ingress.num_replicas, s.ingress.max_replicas_per_node) == (nodes, 1)
    assert s.ingress.num_cpus == 0  # so one fits on the head (num-cpus 0) too
    assert s.metrics_dir is not None and s.metrics_dir.startswith("/")  # the same path after a rebuild


def test_the_worker_groups_hold_every_deployment_at_its_maximum(service: dict[str, Any]) -> None:
    s = settings_of(yaml.safe_load(service["spec"]["serveConfigV2"]))
    groups = _groups(service)
    capacity = {}
    for name in ("cpu", "gpu"):
        limits = _container(groups[name])["resources"]["limits"]
        capacity[name] = (_quantity(limits["cpu"]), float(limits.get(GPU, 0)), groups[name]["maxReplicas"])
    demand = {"cpu": [0.0, 0.0], "gpu": [0.0, 0.0]}
    for name, dep in s.deployments.items():
        group = "gpu" if dep.num_gpus else "cpu"
        cpus, gpus, _ = capacity[group]
        assert dep.num_cpus <= cpus and (dep.num_gpus or 0) <= max(gpus, 0), f"{name} fits no {group} worker"
        replicas = dep.autoscaling_config["max_replicas"]  # type: ignore[index]
        demand[group][0] += dep.num_cpus * replicas
        demand[group][1] += (dep.num_gpus or 0) * replicas
    for group, (cpus, gpus, pods) in capacity.items():
        assert demand[group][0] <= cpus * pods and demand[group][1] <= gpus * pods, group


def test_podmonitor_scrapes_metrics_on_the_serve_port_of_every_pod(service: dict[str, Any]) -> None:
    monitor = yaml.safe_load((K8S / "podmonitor.yaml").read_text())
    schema = {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"enum": ["monitoring.coreos.com/v1"]}, "kind": {"enum": ["PodMonitor"]},
            "metadata": {"type": "object", "required": ["name"]},
            "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"],
                     "additionalProperties": False,
                     "properties": {
                         "selector": {"type": "object", "required": ["matchLabels"]},
                         "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "required": ["port", "path"], "additionalProperties": False,
                             "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                            "interval": {"type": "string", "pattern": "^[0-9]+s$"},
                                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+s$"}}}}}},
        },
    }
    jsonschema.validate(monitor, schema)
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints["serve"]["path"] == "/metrics"
    for name, g in _groups(service).items():
        labels = g["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"the PodMonitor does not select the {name} pods"
        ports = {p["name"]: p["containerPort"] for p in _container(g)["ports"]}
        assert set(endpoints) <= set(ports), name
        assert ports["serve"] == 8000


def test_kustomization_lists_the_manifests() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")
    assert [i["name"] for i in kustomization["images"]] == ["transformer-serve"]


def test_pods_outlive_serves_ingress_drain(service: dict[str, Any]) -> None:
    """Serve (throughput mode) keeps a stopping ingress replica open RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
    (30 s), then lets it finish its requests for its graceful_shutdown_timeout_s (the longest model drain
    + a margin, service/app.py): a pod must not be killed before that (Kubernetes' default is 30 s)."""
    drain_s = 30.0  # Ray 2.60's default (the tests' local clusters shorten it)
    settings = settings_of(yaml.safe_load(service["spec"]["serveConfigV2"]))
    for name, group in _groups(service).items():
        grace = group["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace >= drain_s + ingress_grace_s(settings), name

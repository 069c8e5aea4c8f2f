"""The deployment files agree with the server and with each other: settings names, ports,
probes, timeouts, labels, metric names. Plain parsing; the tools that validate these files
(hadolint, kustomize, the Kubernetes schemas, promtool) run in
tests/integration/test_deploy_tools.py."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
DOCKER = ROOT / "docker"
VOLUME = "/var/cache/stoker"
PRE_STOP_S = 5


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions of each named stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            current = []
            stages[rest.split()[-1]] = current
        current.append((keyword, rest.strip()))
    return stages


def stage_env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            env.update(dict(token.split("=", 1) for token in shlex.split(rest)))
    return env


def setting_exists(variable: str) -> bool:
    """Whether ``STOKER_SECTION__FIELD`` names a real settings field."""
    path = variable.removeprefix("STOKER_").lower().split("__")
    model: type[BaseModel] = Settings
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i < len(path) - 1:
            annotation = field.annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return False
            model = annotation
    return True


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def base(kind: str) -> dict[str, Any]:
    for path in (K8S / "base").glob("*.yaml"):
        for doc in load_all(path):
            if doc.get("kind") == kind:
                return doc
    raise AssertionError(f"no {kind} in k8s/base")


def base_config() -> dict[str, str]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    return dict(literal.split("=", 1) for literal in generator["literals"])


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


# -- Dockerfile -----------------------------------------------------------------------------


def test_dockerfile_has_cpu_and_gpu_targets_on_pinned_images() -> None:
    stages = dockerfile_stages()
    assert {"cpu", "gpu"} <= set(stages)
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    assert args["TENSORRT_IMAGE"].startswith("nvcr.io/nvidia/tensorrt:")
    assert args["PYTHON_IMAGE"].startswith("python:3.11")
    for image in args.values():
        tag = image.rpartition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d", tag), f"{image} is not pinned"
    assert "TensorRT 10." in text and "CUDA 13." in text, "say what the gpu base carries"


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_runtime_stage_is_non_root_with_store_volume_and_readiness_healthcheck(
    target: str,
) -> None:
    stage = dockerfile_stages()[target]
    users = [rest for keyword, rest in stage if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    volumes = [json.loads(rest) for keyword, rest in stage if keyword == "VOLUME"]
    assert volumes == [[VOLUME]]
    (healthcheck,) = [rest for keyword, rest in stage if keyword == "HEALTHCHECK"]
    assert "/v2/health/ready" in healthcheck and "--start-period=" in healthcheck
    env = stage_env(stage)
    assert env["STOKER_STORE__PATH"].startswith(VOLUME + "/")
    assert env["STOKER_SERVER__HOST"] == "0.0.0.0"
    exposed = f"EXPOSE {env['STOKER_SERVER__PORT']} {env['STOKER_SERVER__GRPC_PORT']}"
    assert exposed in [f"{k} {r}" for k, r in stage]
    assert ("ENTRYPOINT", '["stoker"]') in stage and ("CMD", '["serve"]') in stage


def test_default_model_is_prepared_at_build_time() -> None:
    runs = [rest for keyword, rest in dockerfile_stages()["cpu-build"] if keyword == "RUN"]
    assert any("stoker prepare" in run and "efficientnet_lite0" in run for run in runs)
    assert any("docker/install.sh" in run for run in runs)
    gpu_runs = [rest for keyword, rest in dockerfile_stages()["gpu-build"] if keyword == "RUN"]
    (install,) = [shlex.split(run) for run in gpu_runs if "docker/install.sh" in run]
    assert install[4].split(",") == ["default-model", "gpu", "tracing"], "one install script"
    with (ROOT / "pyproject.toml").open("rb") as file:
        extras = tomllib.load(file)["project"]["optional-dependencies"]
    assert {"torch", "cuda-python", "nvidia-ml-py"} <= {
        re.split(r"[<>=\[]", requirement)[0] for requirement in extras["gpu"]
    }


def installed_packages() -> list[str]:
    """The top-level packages pyproject.toml installs (``app*`` includes ``app`` and below)."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        found = tomllib.load(file)["tool"]["setuptools"]["packages"]["find"]
    return [pattern.removesuffix("*") for pattern in found["include"]]


@pytest.mark.parametrize("stage", ["cpu-build", "gpu-build"])
def test_build_stages_copy_every_package_the_project_installs(stage: str) -> None:
    packages = installed_packages()
    copied = {
        shlex.split(rest)[0] for keyword, rest in dockerfile_stages()[stage] if keyword == "COPY"
    }
    assert set(packages) <= copied
    assert {"pyproject.toml", "docker/install.sh"} <= copied


def test_dockerignore_is_an_allow_list() -> None:
    rules = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert rules[0] == "*"
    packages = installed_packages()
    for needed in ("pyproject.toml", "README.md", "models/", *(f"{p}/" for p in packages)):
        assert f"!{needed}" in rules


# -- settings by environment ----------------------------------------------------------------

# A variable set for a setting that is not in app/settings.py yet, with why it may be set.
NOT_YET = {"STOKER_STORE__PATH": "the engine store's location, read once the store is wired"}


def deployment_variables() -> dict[str, str]:
    """Every STOKER_* variable the deployment files set, with where."""
    found: dict[str, str] = {}
    for target in ("cpu", "gpu"):
        for name in stage_env(dockerfile_stages()[target]):
            found[name] = f"Dockerfile {target}"
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for name in compose["services"]["stoker"]["environment"]:
        found[name] = "docker/compose.yaml"
    for name in base_config():
        found[name] = "k8s/base configMapGenerator"
    runtime = load_all(K8S / "kserve" / "servingruntime.yaml")[0]
    for variable in runtime["spec"]["containers"][0]["env"]:
        found[variable["name"]] = "k8s/kserve"
    return {k: v for k, v in found.items() if k.startswith("STOKER_")}


def test_every_stoker_variable_names_a_real_setting() -> None:
    variables = deployment_variables()
    assert len(variables) >= 6
    unknown = {
        name: where
        for name, where in variables.items()
        if not setting_exists(name) and name not in NOT_YET
    }
    assert unknown == {}, "these variables would be ignored by the server"


def test_setting_lookup_rejects_a_typo() -> None:
    assert setting_exists("STOKER_SERVER__DRAIN_TIMEOUT_S")
    assert not setting_exists("STOKER_SERVER__DRAIN_TIMEOUT")
    assert not setting_exists("STOKER_SERVERS__PORT")


# -- drain timing ---------------------------------------------------------------------------


def drain_timeout() -> float:
    return float(base_config()["STOKER_SERVER__DRAIN_TIMEOUT_S"])


def test_grace_period_outlasts_pre_stop_and_drain() -> None:
    deployment = base("Deployment")
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pre_stop = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["sleep", str(PRE_STOP_S)]
    assert grace >= PRE_STOP_S + drain_timeout() + 5
    assert drain_timeout() <= Settings().server.drain_timeout_s


def test_compose_stop_grace_outlasts_the_drain() -> None:
    stoker = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["stoker"]
    grace = int(stoker["stop_grace_period"].removesuffix("s"))
    assert grace > float(stoker["environment"]["STOKER_SERVER__DRAIN_TIMEOUT_S"])


# -- probes, ports, labels ------------------------------------------------------------------


def test_probes_use_the_v2_health_endpoints_on_the_served_port() -> None:
    spec = container(base("Deployment"))
    port, grpc = spec["ports"]
    assert port["containerPort"] == int(base_config()["STOKER_SERVER__PORT"])
    assert (grpc["name"], grpc["containerPort"]) == (
        "grpc",
        int(base_config()["STOKER_SERVER__GRPC_PORT"]),
    )
    service_ports = {p["name"]: p["targetPort"] for p in base("Service")["spec"]["ports"]}
    assert service_ports == {"http": "http", "grpc": "grpc"}
    allowed = {
        p["port"] for rule in base("NetworkPolicy")["spec"]["ingress"] for p in rule["ports"]
    }
    assert allowed == {"http", "grpc"}
    assert spec["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert spec["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert spec["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    startup = spec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "cold engine build"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec[probe]["httpGet"]["port"] == port["name"]


def test_gpu_overlay_asks_for_one_gpu_and_a_longer_cold_start() -> None:
    patch = load_all(K8S / "overlays" / "gpu" / "gpu.yaml")[0]
    spec = container(patch)
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    startup = spec["startupProbe"]
    cpu_startup = container(base("Deployment"))["startupProbe"]
    assert (
        startup["periodSeconds"] * startup["failureThreshold"]
        > cpu_startup["periodSeconds"] * cpu_startup["failureThreshold"]
    )


def test_selectors_match_the_pods() -> None:
    pod_labels = base("Deployment")["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str]) -> bool:
        return all(pod_labels.get(k) == v for k, v in selector.items())

    assert selects(base("Service")["spec"]["selector"])
    assert selects(base("PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    assert selects(base("NetworkPolicy")["spec"]["podSelector"]["matchLabels"])
    service = base("Service")
    monitor = base("ServiceMonitor")
    assert all(
        service["metadata"]["labels"].get(k) == v
        for k, v in monitor["spec"]["selector"]["matchLabels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}


def test_engine_store_claim_is_mounted_at_the_volume() -> None:
    pod = base("Deployment")["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    mounts = {m["mountPath"]: m["name"] for m in container(base("Deployment"))["volumeMounts"]}
    assert claims[mounts[VOLUME]] == base("PersistentVolumeClaim")["metadata"]["name"]
    assert base_config()["STOKER_STORE__PATH"].startswith(VOLUME + "/")


def test_hpa_scales_on_the_metric_the_adapter_serves() -> None:
    hpa = base("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert hpa["spec"]["minReplicas"] >= 2, "a PodDisruptionBudget needs two pods to mean much"
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "config.yaml").read_text())
    (rule,) = adapter["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert "stoker_inference_queue_duration_seconds_sum" in rule["metricsQuery"]
    assert "stoker_inference_queue_duration_seconds_count" in rule["metricsQuery"]


def test_kserve_runtime_serves_v2_on_its_port() -> None:
    runtime = load_all(K8S / "kserve" / "servingruntime.yaml")[0]
    service = load_all(K8S / "kserve" / "inferenceservice.yaml")[0]
    assert runtime["spec"]["protocolVersions"] == ["v2"]
    (kserve_container,) = runtime["spec"]["containers"]
    env = {e["name"]: e["value"] for e in kserve_container["env"]}
    assert [p["containerPort"] for p in kserve_container["ports"]] == [
        int(env["STOKER_SERVER__PORT"])
    ]
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats


# -- Grafana --------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (DOCKER / "grafana" / "dashboards" / "stoker.json").read_text()
    )
    return data


def test_dashboard_uses_the_provisioned_datasource() -> None:
    provisioned = yaml.safe_load(
        (DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    uids = {source["uid"] for source in provisioned["datasources"]}
    for panel in dashboard()["panels"]:
        assert panel["datasource"]["uid"] in uids
        assert panel["targets"], panel["title"]


def test_dashboard_shows_what_an_operator_needs() -> None:
    expressions = " ".join(
        target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]
    )
    quantile = "histogram_quantile({}, sum by (le, model, version) (rate(stoker_inference_{}_bucket"
    for needed in (
        "stoker_inference_count_total",
        "stoker_inference_request_success_total",
        "stoker_inference_request_failure_total",
        quantile.format(0.5, "request_duration_seconds"),
        quantile.format(0.99, "request_duration_seconds"),
        quantile.format(0.5, "queue_duration_seconds"),
        quantile.format(0.99, "queue_duration_seconds"),
        "stoker_inference_batch_size_sum",
        "stoker_inference_pending_request_count",
        "stoker_gpu_utilization_ratio",
        "stoker_gpu_memory_used_bytes",
    ):
        assert needed in expressions


def test_compose_mounts_exist() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), volume

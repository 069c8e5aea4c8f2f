"""Debian's real Prometheus server on loopback scrapes a running Stoker with the alerting rules
of docker/prometheus loaded; the request p99 and the HPA's queue-time signal are read back
through Prometheus' HTTP query API."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from bench.launch import free_port, stop
from tests.integration.conftest import Server
from tests.integration.test_deploy_tools import DOCKER, adapter_query, tool

SCRAPE_INTERVAL = "1s"


@pytest.fixture
def prometheus(server: Server, tmp_path: Path) -> Iterator[str]:
    binary = tool("prometheus", "Debian package prometheus: make deploy-tools")
    shutil.copy(DOCKER / "prometheus" / "alerts.yml", tmp_path)
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    config["global"]["evaluation_interval"] = SCRAPE_INTERVAL
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [server.address]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={address}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    url = f"http://{address}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "Prometheus not ready in 30 s"
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        stop(process, timeout_s=10)


def query(prometheus: str, expression: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expression}, timeout=5)
    body = response.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def wait_for_value(prometheus: str, expression: str, timeout_s: float = 20) -> float:
    """The expression's single value, once Prometheus has the samples to compute it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = query(prometheus, expression)
        if result and not math.isnan(value := float(result[0]["value"][1])):
            return value
        time.sleep(0.5)
    raise AssertionError(f"no value for {expression} in {timeout_s} s")


def traffic(server: Server, requests: int) -> None:
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": x.ravel().tolist()}]
    }
    with httpx.Client(timeout=10) as client:
        for _ in range(requests):
            client.post(f"{server.url}/v2/models/tiny/infer", json=body).raise_for_status()


@pytest.mark.slow
def test_prometheus_scrapes_stoker_and_answers_the_p99(server: Server, prometheus: str) -> None:
    assert wait_for_value(prometheus, 'up{job="stoker"}') == 1.0

    # Traffic across several scrapes, so rate() has samples on both sides of it.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        traffic(server, 20)
        time.sleep(0.3)

    p99 = wait_for_value(
        prometheus,
        "histogram_quantile(0.99, sum by (le) "
        '(rate(stoker_inference_request_duration_seconds_bucket{model="tiny"}[1m])))',
    )
    assert 0 < p99 < 1.0, p99
    rows = wait_for_value(prometheus, 'sum(rate(stoker_inference_count_total{model="tiny"}[1m]))')
    assert rows > 0
    # Triton's names, as a Triton dashboard asks for them: the mean request time in us.
    triton = wait_for_value(
        prometheus,
        'sum(rate(nv_inference_request_duration_us{model="tiny"}[1m])) / '
        'sum(rate(nv_inference_request_success{model="tiny"}[1m]))',
    )
    assert 0 < triton < 1e6, triton
    # The HPA's signal, as prometheus-adapter would ask for it.
    queue = wait_for_value(prometheus, adapter_query())
    assert 0 <= queue < 1.0
    print(f"p99 {p99 * 1000:.1f} ms, {rows:.0f} rows/s, {queue * 1000:.2f} ms queued/request")

    # The alerting rules load and evaluate against the real series (health "ok").
    alerts = {"StokerQueueTimeHigh", "StokerErrorRateHigh", "StokerDown"}
    deadline = time.monotonic() + 10
    while True:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
        health = {rule["name"]: rule["health"] for group in groups for rule in group["rules"]}
        if health == dict.fromkeys(alerts, "ok"):
            break
        assert set(health) == alerts and time.monotonic() < deadline, health
        time.sleep(0.5)

"""The deployment files under ``deploy/`` hold together: the Grafana dashboard's every query
names a metric a real server exports (one server for the module), the compose file's services
mount files that exist and wire Prometheus and Grafana to each other, the Kubernetes probes
hit ``/health`` on the container's port, the systemd unit starts ``pagedllm serve``."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml


DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedllm.json"
METRIC = re.compile(r"pagedllm:[A-Za-z0-9_:]+")
#: What the dashboard must show (a metric family each panel group reads).
REQUIRED = {
    "throughput": "pagedllm:generation_tokens_total", "ttft": "pagedllm:time_to_first_token_seconds_bucket",
    "tpot": "pagedllm:inter_token_latency_seconds_bucket", "e2e": "pagedllm:e2e_request_latency_seconds_bucket",
    "running": "pagedllm:num_requests_running", "waiting": "pagedllm:num_requests_waiting",
    "kv cache": "pagedllm:kv_cache_usage_perc", "prefix hits": "pagedllm:prefix_cache_hits_total",
    "preemptions": "pagedllm:num_preemptions_total",
}  # fmt: skip


def _yaml(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _queries(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return exprs + [var["definition"] for var in dashboard["templating"]["list"] if var["type"] == "query"]


@pytest.fixture(scope="module")
def scraped_names(server) -> set[str]:
    """The sample names of the shared server's /metrics (a server that has served requests
    exports at least the samples a fresh one does)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = server.get("/metrics").text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_dashboard_query_names_an_exported_metric(scraped_names):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    named = {name for query in queries for name in METRIC.findall(query)}
    assert sorted(named - scraped_names) == []
    assert set(REQUIRED.values()) <= named
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(panel["targets"] for panel in dashboard["panels"])
    assert all(METRIC.search(query) for query in queries)


def test_compose_wires_server_prometheus_and_grafana():
    compose = _yaml(DEPLOY / "docker-compose.yml")[0]
    services = compose["services"]
    assert set(services) == {"pagedllm", "prometheus", "grafana"}
    build = services["pagedllm"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert (context / build["dockerfile"]).is_file() and (context / "Makefile").is_file()
    mounts = {}
    for service in services.values():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume
                mounts[target] = DEPLOY / source
            else:
                assert source in compose["volumes"], volume
    # Prometheus scrapes the compose service on the port it publishes; Grafana reads that Prometheus
    scrape = _yaml(mounts["/etc/prometheus/prometheus.yml"])[0]["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["static_configs"][0]["targets"] == ["pagedllm:8000"]
    assert "8000:8000" in services["pagedllm"]["ports"]
    datasource = _yaml(mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml")[0]["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "9090:9090" in services["prometheus"]["ports"]
    provider = _yaml(mounts["/etc/grafana/provisioning"] / "dashboards" / "pagedllm.yml")[0]["providers"][0]
    dashboards_dir = mounts[provider["options"]["path"]]
    assert (dashboards_dir / DASHBOARD.name).is_file()


def test_dockerfiles_install_with_make_and_serve():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (DEPLOY / name).read_text()
        assert "make install" in text and 'ENTRYPOINT ["pagedllm", "serve"' in text, name
        assert re.search(r"^EXPOSE 8000\b", text, re.M) and "/health" in text, name
    assert "nvidia/cuda" in (DEPLOY / "Dockerfile.cuda").read_text()


def test_kubernetes_probes_hit_health_on_the_container_port():
    directory = DEPLOY / "kubernetes"
    kustomization = _yaml(directory / "kustomization.yaml")[0]
    docs = {doc["kind"]: doc for name in kustomization["resources"] for doc in _yaml(directory / name)}
    assert set(docs) == {"Deployment", "Service", "PersistentVolumeClaim"}
    pod = docs["Deployment"]["spec"]["template"]
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] == "/health" and check["port"] == ports["http"], probe
    assert {port["targetPort"] for port in docs["Service"]["spec"]["ports"]} <= set(ports)
    assert docs["Service"]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {docs["PersistentVolumeClaim"]["metadata"]["name"]}
    assert container["args"][container["args"].index("--grpc-port") + 1] == str(ports["grpc"])


def test_systemd_unit_runs_pagedllm_serve(tmp_path):
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd" / "pagedllm.service")
    service = unit["Service"]
    assert " serve " in service["ExecStart"] and service["ExecStart"].startswith("/opt/pagedllm/.venv/bin/pagedllm")
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    if shutil.which("systemd-analyze") is None:
        return
    # `verify` checks the unit's syntax and directives; the install path does not exist here
    copy = tmp_path / "pagedllm.service"
    copy.write_text((DEPLOY / "systemd" / "pagedllm.service").read_text().replace("/opt/pagedllm/.venv/bin/pagedllm", "/bin/true"))
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr

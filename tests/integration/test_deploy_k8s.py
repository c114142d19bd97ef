"""deploy/helm, deploy/kserve: the chart renders with Helm's own engine (helm-python-sdk
binds Helm's Go SDK), every manifest validates against the Kubernetes schemas
(kubernetes-validate, offline), and what the manifests say about kiln is true of a real
``kiln serve``: its args are accepted, its probes answer, the HPA's metrics are exported."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.conftest import KilnProcess, free_port
from tests.integration.deploy_helpers import (
    ENTRYPOINT,
    KNOWN_CRDS,
    container,
    metric_names_in,
    run_container,
    scrape_names,
)
from tests.integration.monitor_helpers import infer_simple

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kiln"
KSERVE = ROOT / "deploy" / "kserve"
ALERTS = ROOT / "deploy" / "prometheus" / "kiln-alerts.yml"
KUBE_VERSIONS = ("1.25.0", "1.33.0")  # the chart's kubeVersion floor and a recent one

EVERYTHING_ON: dict[str, Any] = {
    "autoscaling": {
        "enabled": True,
        "targetQueueTimeUsPerRequest": "20000",
        "targetCPUUtilizationPercentage": 80,
        "targetLLMRequestsWaitingPerPod": "5",
    },
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "gpus": 1,
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "server": {"modelControlMode": "explicit", "loadModels": ["simple", "mlp"]},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything-on": EVERYTHING_ON,
    "object-storage": {"modelRepository": {"source": "objectStorage"}},
    "gpu-agent": {"gpuAgent": {"enabled": True}},
    "config-map": {
        "modelRepository": {
            "source": "configMap",
            "configMap": {"items": [{"key": "simple.config", "path": "simple/config.pbtxt"}]},
        }
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="kiln", namespace="ml")
    docs = [
        d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text)
    ]
    return [d for d in docs if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(VALUE_SETS[request.param])


def test_chart_lints_clean() -> None:
    for values in VALUE_SETS.values():
        report = helm.lint(CHART, values, strict=True, kube_version="v1.33.0")
        errors = [m for m in report["messages"] if m["severity"] >= 2]  # warning or error
        assert not errors and not report["errors"], report


def test_every_manifest_validates(rendered: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in rendered}
    assert {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget"} <= kinds
    for doc in rendered:
        if doc["kind"] in KNOWN_CRDS:
            continue  # not in the Kubernetes schemas: test_crd_structure
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    # validation above is only worth something if a typo fails it
    deployment = by_kind(render({}), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_crd_structure() -> None:
    docs = render(EVERYTHING_ON) + [
        d for f in sorted(KSERVE.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
    ]
    seen = set()
    for doc in docs:
        if doc["kind"] not in KNOWN_CRDS:
            continue
        api_version, required = KNOWN_CRDS[doc["kind"]]
        assert doc["apiVersion"] == api_version, doc["kind"]
        assert doc["metadata"]["name"]
        for dotted in required:
            node: Any = doc
            for key in dotted.split("."):
                assert key in node, (doc["kind"], dotted)
                node = node[key]
        seen.add(doc["kind"])
    assert seen == set(KNOWN_CRDS)


def test_prometheus_rule_is_the_deploy_rules() -> None:
    copy = CHART / "files" / "kiln-alerts.yml"
    assert copy.read_text() == ALERTS.read_text(), (
        "run: cp deploy/prometheus/kiln-alerts.yml " + str(copy)
    )
    rule = by_kind(render(EVERYTHING_ON), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    monitor = by_kind(render(EVERYTHING_ON), "ServiceMonitor")
    # KilnDown selects up{job="kiln"}: the job label comes from the Service's name label.
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"
    service = by_kind(render(EVERYTHING_ON), "Service")
    assert service["metadata"]["labels"]["app.kubernetes.io/name"] == "kiln"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }


def test_termination_grace_covers_prestop_and_drain(rendered: list[dict[str, Any]]) -> None:
    pod = by_kind(rendered, "Deployment")["spec"]["template"]["spec"]
    kiln = container(pod, "kiln")
    (exit_timeout,) = [
        float(a.split("=", 1)[1]) for a in kiln["args"] if a.startswith("--exit-timeout-secs=")
    ]
    sleep = int(kiln["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert sleep > 0
    assert pod["terminationGracePeriodSeconds"] >= exit_timeout + sleep


def test_a_grace_period_shorter_than_the_drain_is_refused() -> None:
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        render({"terminationGracePeriodSeconds": 20, "server": {"exitTimeoutSecs": 30}})
    with pytest.raises(helm.HelmError, match=r"modelRepository\.source"):
        render({"modelRepository": {"source": "nfs"}})


def test_pods_run_non_root_with_a_read_only_root(rendered: list[dict[str, Any]]) -> None:
    pod = by_kind(rendered, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"] + pod.get("initContainers", []):
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
    mounts = {m["mountPath"]: m for m in container(pod, "kiln")["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert {"/tmp", "/var/lib/kiln/state"} <= set(mounts)  # kiln's only writes


def test_gpu_requests_and_placement() -> None:
    pod = by_kind(render(EVERYTHING_ON), "Deployment")["spec"]["template"]["spec"]
    resources = container(pod, "kiln")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    assert pod["tolerations"] and pod["nodeSelector"]
    cpu_only = container(by_kind(render({}), "Deployment")["spec"]["template"]["spec"], "kiln")
    assert "nvidia.com/gpu" not in cpu_only["resources"].get("limits", {})


def test_hpa_metrics_are_served_by_the_adapter_rules() -> None:
    hpa = by_kind(render(EVERYTHING_ON), "HorizontalPodAutoscaler")
    assert (
        hpa["spec"]["scaleTargetRef"]["name"]
        == by_kind(render(EVERYTHING_ON), "Deployment")["metadata"]["name"]
    )
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {
        "nv_inference_pending_request_count",
        "kiln_queue_time_us_per_request",
        "vllm_num_requests_waiting",
    }
    rules = yaml.safe_load((CHART / "adapter-rules.yaml").read_text())["rules"]
    served = {r["name"]["as"] for r in rules}
    assert wanted <= served
    for r in rules:
        assert re.fullmatch(r["name"]["matches"], metric_names_in(r["seriesQuery"]).pop())


# --- the manifests against a real kiln --------------------------------------------------


@pytest.fixture(scope="module")
def chart_server(
    example_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """kiln started exactly as the chart's Deployment starts it (image entrypoint + args)."""
    ports = {"httpPort": free_port(), "grpcPort": free_port(), "metricsPort": free_port()}
    values = {
        "server": {
            **ports,
            "exitTimeoutSecs": 5,
            "modelControlMode": "explicit",
            "loadModels": ["*"],
        }
    }
    pod = by_kind(render(values), "Deployment")["spec"]["template"]["spec"]
    kiln = container(pod, "kiln")
    argv = [*ENTRYPOINT, *kiln["args"]]
    proc = run_container(
        argv, {"/models": example_repo}, tmp_path_factory.mktemp("chart"), ports["httpPort"]
    )
    yield proc, pod
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _probe(pod: dict[str, Any], kind: str) -> int:
    kiln = container(pod, "kiln")
    get = kiln[kind]["httpGet"]
    port = {p["name"]: p["containerPort"] for p in kiln["ports"]}[get["port"]]
    url = f"{get['scheme'].lower()}://127.0.0.1:{port}{get['path']}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return int(resp.status)


def test_deployment_args_start_kiln_and_probes_answer(
    chart_server: tuple[subprocess.Popen[bytes], dict[str, Any]],
) -> None:
    proc, pod = chart_server
    assert proc.poll() is None
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert _probe(pod, kind) == 200, kind


def test_hpa_and_adapter_metrics_are_exported(
    chart_server: tuple[subprocess.Popen[bytes], dict[str, Any]],
) -> None:
    _, pod = chart_server
    ports = {p["name"]: p["containerPort"] for p in container(pod, "kiln")["ports"]}
    server = KilnProcess(Path("."), http_port=ports["http"], metrics_port=ports["metrics"])
    assert infer_simple(server, 2) == 2
    scraped = scrape_names(server.metrics_url)
    rules = yaml.safe_load((CHART / "adapter-rules.yaml").read_text())["rules"]
    for r in rules:
        for name in metric_names_in(r["seriesQuery"]) | metric_names_in(r["metricsQuery"]):
            # vllm:* exist only with an LLM model: tests/integration/test_llm_vllm_metrics.py
            assert name in scraped or name.startswith("vllm:"), name


def test_sigterm_drains_within_the_grace_period(
    chart_server: tuple[subprocess.Popen[bytes], dict[str, Any]],
) -> None:
    # Last test on this server: the kubelet sends SIGTERM after preStop and SIGKILLs at the
    # end of the grace period; kiln must have exited 0 by then.
    proc, pod = chart_server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=pod["terminationGracePeriodSeconds"]) == 0


def test_kserve_runtime_args_start_kiln(example_repo: Path, tmp_path: Path) -> None:
    docs = yaml.safe_load_all((KSERVE / "servingruntime.yaml").read_text())
    runtime = next(d for d in docs if d["kind"] == "ClusterServingRuntime")
    assert runtime["metadata"]["name"] == "kiln"
    formats = {f["name"]: f for f in runtime["spec"]["supportedModelFormats"]}
    assert {"onnx", "pytorch", "tensorrt", "python"} <= set(formats)
    assert all(formats[f]["autoSelect"] for f in ("onnx", "pytorch", "tensorrt", "python"))
    assert runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    (c,) = runtime["spec"]["containers"]
    assert c["name"] == "kserve-container"  # the name KServe merges the predictor into
    # KServe's conventions: models in /mnt/models, HTTP 8080, gRPC 8081.
    args = " ".join(c["args"])
    for flag in ("--model-repository=/mnt/models", "--http-port=8080", "--grpc-port=8081"):
        assert flag in args
    # What KServe does: substitute {{.Name}}; here also free ports for the fixed ones.
    remap = {str(p): str(free_port()) for p in (8080, 8081, 8082)}
    argv = [a.replace("{{.Name}}", "kiln-mlp") for a in [*c["command"], *c["args"]]]
    argv = [re.sub(r"=(808[012])$", lambda m: "=" + remap[m.group(1)], a) for a in argv]
    http_port = int(remap["8080"])
    assert not any("{{" in a for a in argv)
    proc = run_container(argv, {"/mnt/models": example_repo, "/tmp": tmp_path}, tmp_path, http_port)
    try:
        for kind in ("readinessProbe", "livenessProbe"):
            get = c[kind]["httpGet"]
            url = f"http://127.0.0.1:{remap[str(get['port'])]}{get['path']}"
            with urllib.request.urlopen(url, timeout=5) as resp:
                assert resp.status == 200
        assert (tmp_path / "kiln-kiln-mlp.db").exists()  # the {{.Name}} history path
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_gpu_agent_daemonset_is_off_by_default_and_placed_on_gpu_nodes() -> None:
    assert "DaemonSet" not in {d["kind"] for d in render({})}
    docs = render({"gpuAgent": {"enabled": True}, "serviceMonitor": {"enabled": True}})
    ds = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    agent = container(spec, "gpu-agent")
    assert agent["args"][:2] == ["monitor", "agent"] and "--port=9400" in agent["args"]
    assert "nvidia.com/gpu" not in agent.get("resources", {}).get("limits", {})  # reserves none
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    # The kiln Service must not send inference traffic to agent pods, and the agent's
    # ServiceMonitor selects only the agent's Service.
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    kiln_selector = services["kiln"]["spec"]["selector"]
    labels = pod["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in kiln_selector.items())
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    agent_monitor = monitors["kiln-gpu-agent"]["spec"]
    assert (
        agent_monitor["selector"]["matchLabels"] == services["kiln-gpu-agent"]["spec"]["selector"]
    )
    assert agent_monitor["endpoints"][0]["port"] == "metrics"


def test_gpu_agent_daemonset_args_start_the_agent(tmp_path: Path) -> None:
    from tests.fake_nvml import fake_gpu, write_spec

    port = free_port()
    docs = render({"gpuAgent": {"enabled": True, "port": port}})
    spec = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    agent = container(spec, "gpu-agent")
    argv = [*agent["command"], *agent["args"]]
    assert argv[0] == ENTRYPOINT[0] == "kiln"
    local = [sys.executable, "-m", "kiln", *(a.replace("0.0.0.0", "127.0.0.1") for a in argv[1:])]
    nvml = tmp_path / "nvml.json"
    write_spec(nvml, [fake_gpu("GPU-k8s")])
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, KILN_FAKE_NVML="tests.fake_nvml:from_env",
               KILN_FAKE_NVML_SPEC=str(nvml), NODE_NAME="gpu-node-1")  # fmt: skip
    proc = subprocess.Popen(local, env=env, cwd=root, stdout=subprocess.DEVNULL)
    try:
        probe = agent["readinessProbe"]["httpGet"]["path"]
        text = ""
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe}", timeout=1):
                    pass
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert proc.poll() is None
                time.sleep(0.1)
        assert 'UUID="GPU-k8s"' in text and 'Hostname="gpu-node-1"' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0

"""deploy/kubernetes: every manifest valid for a pinned Kubernetes version (offline, with
kubernetes-validate's bundled schemas, strict: unknown fields fail), the Kustomize base listing
them all, and the reame.conf files of the ConfigMap consistent with what the pods mount."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from shared.config import parse_config
from shared.zmq_keys import check_coordinator_transport

K8S = Path(__file__).resolve().parents[2] / "deploy/kubernetes"
KUBERNETES_VERSION = "1.31.0"  # the oldest release still supported upstream when this was written


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def find(kind: str, name: str) -> dict:
    return next(doc for _, doc in documents() if doc["kind"] == kind and doc["metadata"]["name"] == name)


@pytest.mark.parametrize("source, doc", documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_is_valid_for_the_pinned_kubernetes(source, doc):
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{source}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_validation_rejects_an_unknown_field():
    """The check above can fail: strict validation refuses a misspelt field."""
    doc = find("DaemonSet", "reame-worker")
    broken = {**doc, "spec": {**doc["spec"], "updateStrategi": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk


def _containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def _mounted(workload: dict, container: dict, path: str) -> bool:
    """Whether `path` inside `container` lies on one of its volume mounts (a secret: on an item)."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    target = PurePosixPath(path)
    for mount in container["volumeMounts"]:
        base = PurePosixPath(mount["mountPath"])
        if target != base and base not in target.parents:
            continue
        secret = volumes[mount["name"]].get("secret")
        if secret is None or target == base:
            return True
        return str(target.relative_to(base)) in {item["path"] for item in secret["items"]}
    return False


@pytest.mark.parametrize("workload, conf", [(("Deployment", "reame-gateway"), "gateway.conf"),
                                            (("DaemonSet", "reame-worker"), "worker.conf")])
def test_config_parses_and_its_paths_are_mounted(workload, conf):
    doc = find(*workload)
    text = find("ConfigMap", "reame-config")["data"][conf]
    config = parse_config(text, "/etc/reame/reame.conf")  # unknown keys fail here
    main = doc["spec"]["template"]["spec"]["containers"][0]
    assert any(m.get("subPath") == conf and m["mountPath"] == "/etc/reame/reame.conf" for m in main["volumeMounts"])
    server = config.server
    paths = [config.model.model_path, server.curve_gateway_key]
    paths += [server.curve_authorized_keys] if conf == "gateway.conf" else [
        server.curve_worker_key, config.prefix_cache.store_path, config.speculative.archive_path]
    for path in paths:
        assert path and _mounted(doc, main, path), f"{conf}: {path} is not mounted in {workload[1]}"
    if conf == "gateway.conf":
        assert server.curve_gateway_key.endswith(".key_secret")
    else:
        assert server.curve_gateway_key.endswith(".key")  # workers never see the gateway's secret


def test_the_coordinator_runs_alone_over_curve_with_its_keys_mounted_and_its_strategy_kept():
    deployment = find("Deployment", "reame-coordinator")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    main = deployment["spec"]["template"]["spec"]["containers"][0]
    assert main["command"][0] == "reame-coordinator"
    assert any(m.get("subPath") == "coordinator.conf" and m["mountPath"] == "/etc/reame/reame.conf"
               for m in main["volumeMounts"])
    config = parse_config(find("ConfigMap", "reame-coordinator-config")["data"]["coordinator.conf"],
                          "/etc/reame/reame.conf")  # unknown keys fail here
    tuning = config.tuning
    check_coordinator_transport(config)  # a tcp:// endpoint: CURVE, not insecure_tcp
    assert not config.server.insecure_tcp and tuning.curve_coordinator_key.endswith(".key_secret")
    for path in (tuning.curve_coordinator_key, tuning.curve_authorized_gateways, tuning.state_path):
        assert _mounted(deployment, main, path), f"coordinator.conf: {path} is not mounted"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    state = next(m for m in main["volumeMounts"] if tuning.state_path.startswith(m["mountPath"]))
    claim = volumes[state["name"]]["persistentVolumeClaim"]["claimName"]
    assert find("PersistentVolumeClaim", claim)  # the strategy outlives the pod
    port = int(tuning.coordinator.rsplit(":", 1)[1])
    assert main["ports"][0]["containerPort"] == port
    service = find("Service", "reame-coordinator")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == port


def test_the_gateways_are_advised_by_the_coordinator_over_curve():
    gateway = find("Deployment", "reame-gateway")
    main = gateway["spec"]["template"]["spec"]["containers"][0]
    config = parse_config(find("ConfigMap", "reame-config")["data"]["gateway.conf"], "/etc/reame/reame.conf")
    service, coordinator = find("Service", "reame-coordinator"), find("Deployment", "reame-coordinator")
    assert config.tuning.coordinator == (f"tcp://{service['metadata']['name']}.{service['metadata']['namespace']}"
                                         f".svc.cluster.local:{service['spec']['ports'][0]['port']}")
    check_coordinator_transport(config)
    assert config.tuning.curve_coordinator_key.endswith(".key")  # gateways never see the coordinator's secret
    assert _mounted(gateway, main, config.tuning.curve_coordinator_key)
    # The coordinator lets in the key whose secret the gateways hold.
    authorized = next(v for v in coordinator["spec"]["template"]["spec"]["volumes"] if v["name"] == "curve-gateways")
    assert [item["key"] for item in authorized["secret"]["items"]] == [
        PurePosixPath(config.server.curve_gateway_key).name.removesuffix("_secret")]


def test_worker_pods_get_exclusive_cores_and_a_numa_node():
    worker = find("DaemonSet", "reame-worker")["spec"]["template"]["spec"]["containers"][0]
    resources = worker["resources"]
    assert resources["requests"] == resources["limits"]
    assert float(resources["requests"]["cpu"]) == int(float(resources["requests"]["cpu"]))  # whole CPUs
    assert "$(REAME_NUMA_NODE)" in worker["command"]
    assert any(e["name"] == "REAME_NUMA_NODE" for e in worker["env"])


def test_gateways_are_probed_on_health_and_scraped():
    pod = find("Deployment", "reame-gateway")["spec"]["template"]
    gateway = pod["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "/health" in " ".join(gateway["livenessProbe"]["exec"]["command"])
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    budgets = {doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
               for _, doc in documents() if doc["kind"] == "PodDisruptionBudget"}
    assert budgets == {"reame-gateway", "reame-worker"}


def _kustomize() -> list[str] | None:
    """kustomize itself, or the one built into kubectl (`kubectl kustomize`, kustomize v5 since 1.27)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.system_tool("kustomize", "kubectl", package=None)
def test_kustomize_builds_valid_manifests():
    built = subprocess.run([*_kustomize(), str(K8S)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert len(docs) == len(documents())
    for doc in docs:
        assert doc["metadata"].get("namespace", "reame") == "reame"
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)

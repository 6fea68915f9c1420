"""deploy/kubernetes (kustomize base, cpu and gpu overlays, autoscaling) and the Grafana
dashboard deploy/grafana/pagedserve.json, checked without a cluster.

Each overlay is rendered with `kubectl kustomize` (Debian's kubernetes-client, kubectl 1.20,
or any newer kubectl; `KUBECTL=/path/to/kubectl` picks one) into a copy of the folder where
`pagedserve keygen` has written the CURVE keys, as README "On Kubernetes" does. Rendering
skips when kubectl is absent; validation against the Kubernetes 1.29 schemas (strict: no
unknown fields) uses kubernetes-validate, offline (it bundles the schemas), and skips when it
is not installed. Expected ports, timeouts and names come from the flag table, the key
layout of `pagedserve keygen`, the router's health service and its metrics registry.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedserve import keygen
from pagedserve.flags import FLAGS, env_name

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "pagedserve.json"
KUBECTL = os.environ.get("KUBECTL", "kubectl")
OVERLAYS = ("cpu", "gpu", "disaggregated")
RENDERED = (*OVERLAYS, "autoscaling")
VALIDATE_VERSION = "1.29"
CRD_KINDS = {"ServiceMonitor"}  # not in the Kubernetes schemas; checked structurally

DEFAULTS = {flag: default for flag, _type, default, _help in FLAGS}
FLAG_TYPES = {env_name(flag): type_ for flag, type_, _default, _help in FLAGS}
ROUTER_LABELS = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "router"}
EXECUTOR_LABELS = {"app.kubernetes.io/name": "pagedserve",
                   "app.kubernetes.io/component": "executor"}
ROLE = "pagedserve.io/disaggregation"  # the disaggregated overlay's two executor Deployments


def _ids(folder: str) -> str:
    # never the bare id "gpu": tests/conftest.py skips items with a `gpu` keyword without CUDA
    return f"k8s-{folder}"


# ----------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """{folder: its objects}, rendered by kubectl with freshly made keys."""
    yaml = pytest.importorskip("yaml")
    if shutil.which(KUBECTL) is None:
        pytest.skip(f"{KUBECTL} not installed (Debian: kubernetes-client); "
                    "kustomize rendering not checked")
    work = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(K8S, work, ignore=shutil.ignore_patterns("keys"))
    # README: `pagedserve keygen deploy/kubernetes/base/keys`, then `kubectl apply -k <overlay>`
    assert keygen.main([str(work / "base" / "keys")]) == 0
    out = {}
    for name in RENDERED:
        result = subprocess.run([KUBECTL, "kustomize", str(work / name)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"kubectl kustomize {name}: {result.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def _one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _generated(objects: list[dict], kind: str, name: str) -> dict:
    """A generated ConfigMap or Secret (kustomize appends a content hash to the name)."""
    found = [o for o in objects if o["kind"] == kind
             and re.fullmatch(re.escape(name) + r"(-[a-z0-9]+)?", o["metadata"]["name"])]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _container(deployment: dict) -> dict:
    containers = _pod(deployment)["containers"]
    assert len(containers) == 1
    return containers[0]


def _config(objects: list[dict]) -> dict[str, str]:
    return _generated(objects, "ConfigMap", "pagedserve-config")["data"]


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("name", RENDERED, ids=_ids)
def test_validates_against_kubernetes_1_29(rendered, name):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install .[test])")
    unvalidated = set()
    for obj in rendered[name]:
        try:
            kubernetes_validate.validate(obj, VALIDATE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unvalidated.add(obj["kind"])
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} {path}: {exc.message}")
    assert unvalidated <= CRD_KINDS, unvalidated


def test_overlays_hold_the_same_objects_and_no_autoscaling(rendered):
    def names(objects):
        return {(o["kind"], re.sub(r"-[a-z0-9]{10}$", "", o["metadata"]["name"]))
                for o in objects}
    common = {("Deployment", "pagedserve-router"), ("Deployment", "pagedserve-executor"),
              ("Service", "pagedserve"), ("Service", "pagedserve-executor-socket"),
              ("ConfigMap", "pagedserve-config"), ("Secret", "pagedserve-curve-keys"),
              ("PersistentVolumeClaim", "pagedserve-models"),
              ("NetworkPolicy", "pagedserve-router"), ("NetworkPolicy", "pagedserve-executor")}
    assert names(rendered["gpu"]) == common
    assert names(rendered["disaggregated"]) == common | {("Deployment",
                                                          "pagedserve-executor-decode")}
    assert names(rendered["cpu"]) == common | {("PersistentVolume", "pagedserve-models")}
    for overlay in OVERLAYS:  # no Job, no RBAC, no autoscaling unless asked for
        kinds = {o["kind"] for o in rendered[overlay]}
        assert not kinds & {"Job", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding",
                            "ServiceAccount", "HorizontalPodAutoscaler", "ServiceMonitor"}


# ----------------------------------------------------------------------------- router


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_router_is_one_replica_recreated(rendered, overlay):
    router = _one(rendered[overlay], "Deployment", "pagedserve-router")
    assert router["spec"]["replicas"] == 1
    assert router["spec"]["strategy"] == {"type": "Recreate"}  # never two routers at once
    assert router["spec"]["selector"]["matchLabels"] == ROUTER_LABELS
    assert _container(router)["args"] == ["router"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_client_service_ports_match_the_flag_defaults(rendered, overlay):
    objects = rendered[overlay]
    service = _one(objects, "Service", "pagedserve")
    expected = {"grpc": DEFAULTS["port"], "metrics": DEFAULTS["metrics-port"],
                "http": DEFAULTS["http-port"]}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == expected
    assert service["spec"]["selector"] == ROUTER_LABELS
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    router = _container(_one(objects, "Deployment", "pagedserve-router"))
    container_ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    for port in service["spec"]["ports"]:
        assert container_ports[port["targetPort"]] == port["port"]
    config = _config(objects)
    assert config["PAGEDSERVE_HOST"] == "0.0.0.0"  # reachable on the pod's address
    assert int(config["PAGEDSERVE_PORT"]) == expected["grpc"]
    assert int(config["PAGEDSERVE_METRICS_PORT"]) == expected["metrics"]
    assert int(config["PAGEDSERVE_HTTP_PORT"]) == expected["http"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_executor_socket_service_is_internal_and_publishes_not_ready(rendered, overlay):
    objects = rendered[overlay]
    service = _one(objects, "Service", "pagedserve-executor-socket")
    zmq_port = _port_of(DEFAULTS["executor-bind"])
    assert service["spec"]["type"] == "ClusterIP"
    # the router is ready only once an executor joined, and executors join through here
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert [p["port"] for p in service["spec"]["ports"]] == [zmq_port]
    assert service["spec"]["selector"] == ROUTER_LABELS
    router = _container(_one(objects, "Deployment", "pagedserve-router"))
    target = service["spec"]["ports"][0]["targetPort"]
    assert {p["name"]: p["containerPort"] for p in router["ports"]}[target] == zmq_port
    config = _config(objects)
    assert config["PAGEDSERVE_EXECUTOR_BIND"] == f"tcp://0.0.0.0:{zmq_port}"
    assert config["PAGEDSERVE_ROUTER"] == f"tcp://pagedserve-executor-socket:{zmq_port}"
    assert "PAGEDSERVE_ALLOW_INSECURE" not in config  # CURVE instead
    # nothing else exposes the executor socket
    for other in (o for o in objects if o["kind"] == "Service" and o is not service):
        assert zmq_port not in [p["port"] for p in other["spec"]["ports"]]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_no_service_selects_executors(rendered, overlay):
    for service in (o for o in rendered[overlay] if o["kind"] == "Service"):
        selector = service["spec"].get("selector") or {}
        assert selector, f"{service['metadata']['name']} selects nothing by label"
        assert not selector.items() <= EXECUTOR_LABELS.items(), service["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_router_probes_are_native_grpc_on_the_health_services(rendered, overlay):
    from pagedserve.router.grpc_server import SERVICE_NAME

    router = _container(_one(rendered[overlay], "Deployment", "pagedserve-router"))
    grpc_port = DEFAULTS["port"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert router[probe]["grpc"]["port"] == grpc_port, probe
    # "" = the process is up; Generator = SERVING once an executor is registered (DESIGN §3)
    assert router["startupProbe"]["grpc"].get("service", "") == ""
    assert router["livenessProbe"]["grpc"].get("service", "") == ""
    assert router["readinessProbe"]["grpc"]["service"] == SERVICE_NAME == "pagedserve.v1.Generator"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_grace_periods_exceed_the_drain(rendered, overlay):
    objects = rendered[overlay]
    config = _config(objects)
    drain_s = float(config.get("PAGEDSERVE_SHUTDOWN_TIMEOUT", DEFAULTS["shutdown-timeout"]))
    router = _one(objects, "Deployment", "pagedserve-router")
    assert _pod(router)["terminationGracePeriodSeconds"] > drain_s
    # an executor says goodbye after the step in hand, which the router waits for about
    # --step-timeout before it counts the executor dead
    step_timeout_s = float(config.get("PAGEDSERVE_STEP_TIMEOUT", DEFAULTS["step-timeout"]))
    executor = _one(objects, "Deployment", "pagedserve-executor")
    assert _pod(executor)["terminationGracePeriodSeconds"] > step_timeout_s


# ----------------------------------------------------------------------------- executors


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_executor_deployment_is_scalable_and_opens_nothing(rendered, overlay):
    executor = _one(rendered[overlay], "Deployment", "pagedserve-executor")
    # no replicas: `kubectl apply -k` again keeps what `kubectl scale` or the HPA set
    assert "replicas" not in executor["spec"]
    labels = EXECUTOR_LABELS | ({ROLE: "prefill"} if overlay == "disaggregated" else {})
    assert executor["spec"]["selector"]["matchLabels"] == labels
    assert executor["spec"]["template"]["metadata"]["labels"] == labels
    rolling = executor["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 1, "maxUnavailable": 0}  # the new one first
    container = _container(executor)
    assert container["args"] == ["executor"]
    assert "ports" not in container
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(container)


def test_gpu_overlay_gives_each_executor_one_gpu(rendered):
    objects = rendered["gpu"]
    executor = _container(_one(objects, "Deployment", "pagedserve-executor"))
    assert executor["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert executor["image"].endswith(":cu128")
    router = _container(_one(objects, "Deployment", "pagedserve-router"))
    assert "nvidia.com/gpu" not in json.dumps(router["resources"])  # the router needs none
    config = _config(objects)
    assert config["PAGEDSERVE_DEVICE"] == "cuda"
    # GPU steps are short: the router's edges run in API workers, one CPU each plus the engine.
    workers = int(config["PAGEDSERVE_API_WORKERS"])
    assert workers == 2 and float(router["resources"]["requests"]["cpu"]) == workers + 1
    assert router["resources"]["requests"]["memory"] == "1Gi"  # the base's, kept by the merge
    # GPU steps are short enough that the router's round trip needs three forwards to hide in.
    assert config["PAGEDSERVE_PIPELINE_DEPTH"] == "4"


def test_cpu_overlay_runs_executors_on_cpu_with_a_hostpath_model(rendered):
    objects = rendered["cpu"]
    executor = _container(_one(objects, "Deployment", "pagedserve-executor"))
    assert "nvidia.com/gpu" not in json.dumps(executor["resources"])
    config = _config(objects)
    assert config["PAGEDSERVE_DEVICE"] == "cpu"
    assert float(executor["resources"]["requests"]["cpu"]) == int(config["PAGEDSERVE_CPU_THREADS"])
    volume = _one(objects, "PersistentVolume", "pagedserve-models")
    claim = _one(objects, "PersistentVolumeClaim", "pagedserve-models")
    assert volume["spec"]["hostPath"]["path"]
    assert claim["spec"]["volumeName"] == volume["metadata"]["name"]
    assert claim["spec"]["storageClassName"] == volume["spec"]["storageClassName"] == ""
    assert set(claim["spec"]["accessModes"]) <= set(volume["spec"]["accessModes"])


# ----------------------------------------------------------------------------- both


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_config_is_one_configmap_of_real_flags(rendered, overlay):
    objects = rendered[overlay]
    config = _config(objects)
    for name, value in config.items():
        assert name in FLAG_TYPES, f"{name} is not PAGEDSERVE_<FLAG> of pagedserve.flags.FLAGS"
        FLAG_TYPES[name](value)  # raises on a bad value, as `pagedserve` would
    assert config["PAGEDSERVE_MODEL"].startswith("/models/")
    config_name = _generated(objects, "ConfigMap", "pagedserve-config")["metadata"]["name"]
    for deployment in ("pagedserve-router", "pagedserve-executor"):
        container = _container(_one(objects, "Deployment", deployment))
        assert container["envFrom"] == [{"configMapRef": {"name": config_name}}]
        hf_token = {e["name"]: e for e in container["env"]}["HF_TOKEN"]
        assert hf_token["valueFrom"]["secretKeyRef"]["optional"] is True
    # API keys: the router's alone, from an optional Secret (absent: no key needed)
    assert "PAGEDSERVE_API_KEY" not in config
    router = {e["name"]: e for e in _container(_one(objects, "Deployment",
                                                    "pagedserve-router"))["env"]}
    assert router["PAGEDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "pagedserve-api-key", "key": "keys", "optional": True}
    executor = _container(_one(objects, "Deployment", "pagedserve-executor"))
    assert "PAGEDSERVE_API_KEY" not in {e["name"] for e in executor["env"]}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_curve_keys_come_from_keygen_and_are_mounted_read_only(rendered, overlay):
    objects = rendered[overlay]
    secret = _generated(objects, "Secret", "pagedserve-curve-keys")
    files = {n + ext for n in keygen.key_names(None) for ext in (".key", ".key_secret")}
    assert set(secret["data"]) == files
    config = _config(objects)
    # each pod gets only what `pagedserve.keygen` says it reads
    needs = {"pagedserve-router": {"router.key_secret", "executor.key"},
             "pagedserve-executor": {"router.key", "executor.key_secret"}}
    for deployment, wanted in needs.items():
        pod = _pod(_one(objects, "Deployment", deployment))
        volume = next(v for v in pod["volumes"] if "secret" in v)
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert {i["key"] for i in volume["secret"]["items"]} == wanted
        assert {i["path"] for i in volume["secret"]["items"]} == wanted
        assert volume["secret"]["defaultMode"] == 0o440  # group: fsGroup = the image's user
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 10001
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True
        assert mount["mountPath"] == config["PAGEDSERVE_CURVE_KEYS"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_pods_run_unprivileged_without_service_links(rendered, overlay):
    for deployment in ("pagedserve-router", "pagedserve-executor"):
        pod = _pod(_one(rendered[overlay], "Deployment", deployment))
        # service links would set PAGEDSERVE_PORT=tcp://... (from the Service `pagedserve`),
        # which pagedserve reads as --port
        assert pod["enableServiceLinks"] is False
        assert pod["automountServiceAccountToken"] is False  # no kubectl, no RBAC inside
        assert pod["securityContext"]["runAsNonRoot"] is True
        container = pod["containers"][0]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        models = next(v for v in pod["volumes"] if v["name"] == "models")
        assert models["persistentVolumeClaim"] == {"claimName": "pagedserve-models",
                                                   "readOnly": True}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
        assert mount["readOnly"] is True and mount["mountPath"] == "/models"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_ids)
def test_network_policy_lets_only_executors_reach_the_executor_socket(rendered, overlay):
    objects = rendered[overlay]
    zmq_port = _port_of(DEFAULTS["executor-bind"])
    router = _one(objects, "NetworkPolicy", "pagedserve-router")
    assert router["spec"]["podSelector"]["matchLabels"] == ROUTER_LABELS
    assert router["spec"]["policyTypes"] == ["Ingress"]
    rules = router["spec"]["ingress"]
    zmq_rules = [r for r in rules if zmq_port in [p["port"] for p in r["ports"]]]
    assert len(zmq_rules) == 1
    assert [p["port"] for p in zmq_rules[0]["ports"]] == [zmq_port]
    assert zmq_rules[0]["from"] == [{"podSelector": {"matchLabels": EXECUTOR_LABELS}}]
    client_ports = {p["port"] for p in _one(objects, "Service", "pagedserve")["spec"]["ports"]}
    opened = {p["port"] for r in rules for p in r["ports"]}
    assert opened == client_ports | {zmq_port}
    executor = _one(objects, "NetworkPolicy", "pagedserve-executor")
    assert executor["spec"]["podSelector"]["matchLabels"] == EXECUTOR_LABELS
    assert executor["spec"]["policyTypes"] == ["Ingress"]
    assert executor["spec"].get("ingress", []) == []  # executors open nothing


# ----------------------------------------------------------------------------- autoscaling


def test_autoscaling_scales_executors_on_the_summed_waiting_queue(rendered):
    yaml = pytest.importorskip("yaml")
    objects = rendered["autoscaling"]
    hpa = _one(objects, "HorizontalPodAutoscaler", "pagedserve-executor")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "pagedserve-executor"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "pagedserve_requests_waiting"
    assert "pagedserve_requests_waiting" in _metric_names()
    assert metric["external"]["target"]["type"] == "AverageValue"  # per executor
    assert hpa["spec"]["minReplicas"] >= 1
    # the adapter rule sums the per-executor gauge
    values = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    [rule] = values["rules"]["external"]
    assert rule["name"]["as"] == "pagedserve_requests_waiting"
    assert "pagedserve_requests_waiting" in rule["seriesQuery"]
    assert rule["metricsQuery"].startswith("sum(<<.Series>>")
    # the ServiceMonitor scrapes the client Service's metrics port, not the executor socket
    monitor = _one(objects, "ServiceMonitor", "pagedserve")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    services = {o["metadata"]["name"]: o for o in rendered["gpu"] if o["kind"] == "Service"}
    selected = [n for n, s in services.items()
                if monitor["spec"]["selector"]["matchLabels"].items()
                <= s["metadata"]["labels"].items()]
    assert selected == ["pagedserve"]
    assert "metrics" in [p["name"] for p in services["pagedserve"]["spec"]["ports"]]


# ----------------------------------------------------------------------------- sources


def test_base_files_without_kubectl():
    """What holds without rendering: the key files named are keygen's default layout, and
    the env file holds real flags with values that parse."""
    yaml = pytest.importorskip("yaml")
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    [secret] = base["secretGenerator"]
    assert sorted(secret["files"]) == sorted(
        f"keys/{n}{ext}" for n in keygen.key_names(None) for ext in (".key", ".key_secret"))
    assert "base/keys/" in (K8S / ".gitignore").read_text().split()
    [config] = base["configMapGenerator"]
    for line in (K8S / "base" / config["env"]).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, value = line.split("=", 1)
            assert name in FLAG_TYPES, name
            FLAG_TYPES[name](value)
    readme = (ROOT / "README.md").read_text()
    assert "pagedserve keygen deploy/kubernetes/base/keys" in readme
    assert "kubectl apply -k deploy/kubernetes/cpu" in readme


def _metric_names() -> set[str]:
    """Every series name the router exports (DESIGN §5), from its metrics registry."""
    from pagedserve.router.metrics import RouterMetrics

    names = set()
    for family in RouterMetrics().registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def _queries(dashboard: dict) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def test_dashboard_queries_only_design_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    known = _metric_names()
    exprs = _queries(dashboard)
    assert exprs
    used = set()
    for expr in exprs:
        for name in re.findall(r"\bpagedserve_[a-z0-9_]+", expr):
            assert name in known, f"{name} is not a DESIGN §5 series: {expr}"
            used.add(name)
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), expr
    # what the dashboard is for: rates, latency quantiles, the executors' state
    assert {
        "pagedserve_request_success_total", "pagedserve_generation_tokens_total",
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_inter_token_latency_seconds_bucket",
        "pagedserve_requests_running", "pagedserve_requests_waiting",
        "pagedserve_kv_cache_usage_ratio", "pagedserve_prefix_cache_hits_total",
        "pagedserve_prefix_cache_queries_total", "pagedserve_preemptions_total",
        "pagedserve_migrations_total", "pagedserve_executors_healthy",
        "pagedserve_kv_blocks_leaked",
    } <= used
    assert any("histogram_quantile(0.99" in e for e in exprs)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))

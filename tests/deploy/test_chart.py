"""The Helm chart (deploy/helm/kvpool), rendered offline by Helm's own Go engine (helm-python-sdk binds
Helm's SDK; no binary, no cluster), then checked the way a cluster and the programs would check it:

- every object against the Kubernetes JSON schemas (strict: unknown fields fail) of the three newest
  versions kubernetes-validate bundles; the ServiceMonitor, a CRD, field by field;
- every `kvpool` container's command line with kvpool's own argparse parser, after substituting the
  $(VAR)s the kubelet would expand;
- vLLM's --kv-transfer-config against what `kvpool connector-config` prints for the same options;
- the addresses, Services, Secrets and ports the components give each other.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from kubernetes_validate import utils as kube_schemas

from kvpool.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/kvpool"
RELEASE, NAMESPACE = "prod", "llm"
FULLNAME = f"{RELEASE}-kvpool"
SUFFIX = f".{NAMESPACE}.svc.cluster.local"
KUBE_VERSIONS = sorted(set(kube_schemas.all_versions()), key=lambda v: tuple(map(int, v.split("."))))[-3:]
POD_IP = "10.1.2.3"  # what the kubelet would put in $(POD_IP), $(NODE_NAME), ...
FIELD_VALUES = {"status.podIP": POD_IP, "spec.nodeName": "gpu-host-1", "metadata.name": "pod-0"}

VARIANTS: dict[str, dict] = {
    "default": {},
    "external-etcd": {"etcd": {"enabled": False, "endpoints": ["etcd-a.infra:2379", "etcd-b.infra:2379"]}},
    "one-etcd": {"etcd": {"replicas": 1, "persistence": {"enabled": False}}},
    "no-ha": {"master": {"ha": {"enabled": False}, "replicas": 1}, "etcd": {"enabled": False}},
    "disk-tier": {
        "node": {"disk": {"enabled": True, "sizeGiB": 200}, "tenant": "team-a", "memoryGiB": 16,
                 "extraArgs": ["--writeback-queue", "8192"]},
        "hostSharing": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    },
    "insecure": {
        "auth": {"enabled": False},
        "master": {"ha": {"enabled": False}, "replicas": 1, "extraArgs": ["--high-watermark", "0.95"]},
        "router": {"backends": ["http://vllm-a:8000", "http://vllm-b:8000"], "policy": "session"},
        "vllm": {"connectorExtraConfig": {"num_replicas": 2, "tenant": "team-a"},
                 "extraArgs": ["--max-model-len", "32768"]},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
}
HA_VARIANTS = [name for name, v in VARIANTS.items() if v.get("master", {}).get("ha", {}).get("enabled", True)]


def render_files(values: dict | None = None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def render(values: dict | None = None) -> list[dict]:
    objects = []
    for path, text in sorted(render_files(values).items()):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def merged_values(variant: str) -> dict:
    """The values Helm used: the chart's defaults with the variant over them."""
    def merge(base: dict, over: dict) -> dict:
        out = copy.deepcopy(base)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    return merge(yaml.safe_load((CHART / "values.yaml").read_text()), VARIANTS[variant])


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def objects(variant) -> list[dict]:
    return render(VARIANTS[variant])


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def container(objects: list[dict], kind: str, name: str) -> tuple[dict, dict]:
    """(pod spec, its only container) of workload kind/name."""
    spec = find(objects, kind, name)["spec"]["template"]["spec"]
    assert len(spec["containers"]) == 1
    return spec, spec["containers"][0]


def expand(c: dict) -> list[str]:
    """The container's argv as the kubelet runs it: $(VAR) replaced from its env (each must be defined)."""
    env = {}
    for e in c.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else FIELD_VALUES[e["valueFrom"]["fieldRef"]["fieldPath"]]

    def sub(match: re.Match) -> str:
        assert match.group(1) in env, f"{c['name']}: $({match.group(1)}) is not in the container's env"
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in [*c.get("command", []), *c.get("args", [])]]


def parse_kvpool(argv: list[str]):
    """Parse `kvpool SUBCOMMAND ...` with kvpool's own parser; a refused option fails the test."""
    assert argv[0] == "kvpool", argv
    parser = build_parser(only=argv[1])
    try:
        return parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"kvpool rejects the chart's command line: {argv}")


def port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q)).groups()
    return int(number) * units.get(unit, 1)


def etcd_endpoints(variant: str) -> str:
    values = merged_values(variant)
    if not values["etcd"]["enabled"]:
        return ",".join(values["etcd"]["endpoints"])
    name = f"{FULLNAME}-etcd"
    return ",".join(f"{name}-{i}.{name}{SUFFIX}:2379" for i in range(values["etcd"]["replicas"]))


def master_address(variant: str) -> str:
    values = merged_values(variant)
    if values["master"]["ha"]["enabled"]:
        return f"etcd://{etcd_endpoints(variant)}/{RELEASE}"
    return f"tcp://{FULLNAME}-master{SUFFIX}:5555"


# --- Helm's own checks -------------------------------------------------------------------------------

def test_chart_lints_clean(variant):
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_chart_version_is_kvpools():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"]


def test_notes_name_the_master_address(variant):
    notes = render_files(VARIANTS[variant])["kvpool/templates/NOTES.txt"]
    assert master_address(variant) in notes


@pytest.mark.parametrize(("values", "message"), [
    ({"master": {"ha": {"enabled": False}}}, "master.replicas=1"),
    ({"etcd": {"enabled": False}}, "etcd.endpoints"),
    ({"etcd": {"replicas": 2}}, "etcd.replicas must be odd"),
    ({"node": {"memoryGiB": 0}}, "node.memoryGiB"),
    ({"router": {"backends": []}, "vllm": {"enabled": False}}, "router.backends"),
])
def test_impossible_settings_fail_with_what_to_change(values, message):
    with pytest.raises(helm.errors.HelmRenderError, match=re.escape(message)):
        render(values)


# --- Kubernetes' checks ------------------------------------------------------------------------------

@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_objects_match_the_kubernetes_schemas(objects, kube_version):
    assert len(KUBE_VERSIONS) == 3
    checked, errors = 0, []
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema here (test_service_monitor checks it)
        try:
            kube_schemas.validate(obj, kube_version, strict=True)
        except kube_schemas.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
        checked += 1
    assert not errors, f"Kubernetes {kube_version} would refuse: {errors}"
    assert checked >= 8


def test_names_are_unique_and_labelled(objects):
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))
    for o in objects:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE and labels["app.kubernetes.io/managed-by"] == "Helm"


def test_services_reach_pods_and_their_named_ports(objects):
    for svc in (o for o in objects if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [w["spec"]["template"] for w in workloads(objects)
                if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        names = {p["name"] for pod in pods for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in names, f"Service {svc['metadata']['name']}: no container port {p['targetPort']}"


def test_workload_selectors_match_their_pods(objects):
    for w in workloads(objects):
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()


# --- the master --------------------------------------------------------------------------------------

def test_master_command_is_one_kvpool_accepts(objects, variant):
    """With HA on, this needs `kvpool master --ha/--ha-name/--advertise-host`."""
    values = merged_values(variant)
    spec, c = container(objects, "StatefulSet", f"{FULLNAME}-master")
    args = parse_kvpool(expand(c))
    assert args.command == "master"
    assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", port(c, "control"), port(c, "metrics"))
    if values["auth"]["enabled"]:
        assert args.auth is not None and str(args.auth) == "/etc/kvpool/auth" and not args.insecure
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/kvpool/auth")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == values["auth"]["secretName"] and "items" not in volume["secret"]
    else:
        assert args.insecure and "volumes" not in spec
    if values["master"]["ha"]["enabled"]:
        assert args.ha == f"etcd://{etcd_endpoints(variant)}"
        assert args.ha_name == RELEASE
        assert args.advertise_host == POD_IP


def test_master_probes_do_not_need_the_lease(objects):
    """Standbys do not listen on the control port: probing it would keep them unready for ever."""
    _, c = container(objects, "StatefulSet", f"{FULLNAME}-master")
    metrics = {"metrics", port(c, "metrics")}
    assert c["livenessProbe"]["httpGet"]["path"] == "/metrics" and c["livenessProbe"]["httpGet"]["port"] in metrics
    assert c["readinessProbe"]["tcpSocket"]["port"] in metrics


def test_master_replicas(objects, variant):
    values = merged_values(variant)
    sts = find(objects, "StatefulSet", f"{FULLNAME}-master")
    assert sts["spec"]["replicas"] == (3 if values["master"]["ha"]["enabled"] else 1)
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = find(objects, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    if values["master"]["ha"]["enabled"]:
        assert not [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == f"{FULLNAME}-master"]
    else:  # the Service behind the tcp:// address everybody is given
        svc = find(objects, "Service", f"{FULLNAME}-master")
        assert [p["port"] for p in svc["spec"]["ports"]] == [5555]


# --- etcd --------------------------------------------------------------------------------------------

def test_etcd_members_form_one_cluster(objects, variant):
    values = merged_values(variant)
    name = f"{FULLNAME}-etcd"
    if not values["etcd"]["enabled"]:
        assert not [o for o in objects if o["metadata"]["name"].startswith(name)]
        return
    replicas = values["etcd"]["replicas"]
    spec, c = container(objects, "StatefulSet", name)
    assert c["image"].startswith("quay.io/coreos/etcd:v3.")
    flags = dict(a.split("=", 1) for a in expand(c)[1:])
    peers = dict(p.split("=", 1) for p in flags["--initial-cluster"].split(","))
    assert peers == {f"{name}-{i}": f"http://{name}-{i}.{name}{SUFFIX}:2380" for i in range(replicas)}
    assert flags["--name"] == "pod-0" and flags["--initial-advertise-peer-urls"] == f"http://pod-0.{name}{SUFFIX}:2380"
    assert find(objects, "StatefulSet", name)["spec"]["replicas"] == replicas
    assert find(objects, "Service", name)["spec"]["publishNotReadyAddresses"] is True
    claims = find(objects, "StatefulSet", name)["spec"].get("volumeClaimTemplates")
    assert bool(claims) == values["etcd"]["persistence"]["enabled"]


# --- storage nodes -----------------------------------------------------------------------------------

def test_node_command_is_one_kvpool_accepts(objects, variant):
    from kvpool.node.config import parse_size

    values = merged_values(variant)
    spec, c = container(objects, "DaemonSet", f"{FULLNAME}-node")
    args = parse_kvpool(expand(c))
    assert args.command == "node"
    assert args.master == master_address(variant)
    assert parse_size(args.memory) == values["node"]["memoryGiB"] << 30
    assert (args.metrics_port, args.metrics_host) == (port(c, "metrics"), "0.0.0.0")
    assert args.node_id == "gpu-host-1"
    assert args.tenant == values["node"]["tenant"]
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    if values["auth"]["enabled"]:  # the node credential only, never the master's keys
        folder, file = args.credential.rsplit("/", 1)
        secret = volumes[mounts[folder]]["secret"]
        assert secret["secretName"] == values["auth"]["secretName"]
        assert secret["items"] == [{"key": values["auth"]["nodeCredentialKey"], "path": file}]
    else:
        assert args.credential is None
    if values["node"]["disk"]["enabled"]:
        assert parse_size(args.disk_size) == values["node"]["disk"]["sizeGiB"] << 30
        assert volumes[mounts[args.disk]]["hostPath"]["path"] == values["node"]["disk"]["hostPath"]
        assert args.writeback_queue == 8192
    else:
        assert args.disk is None and args.disk_size is None


def test_node_memory_covers_its_segment(objects, variant):
    values = merged_values(variant)
    _, c = container(objects, "DaemonSet", f"{FULLNAME}-node")
    segment = values["node"]["memoryGiB"] << 30
    for side in ("requests", "limits"):
        assert quantity_bytes(c["resources"][side]["memory"]) == segment + (values["node"]["memoryOverheadMiB"] << 20)


def test_host_sharing_puts_nodes_and_vllm_in_the_hosts_namespaces(objects, variant):
    shared = merged_values(variant)["hostSharing"]["enabled"]
    for kind, name in (("DaemonSet", f"{FULLNAME}-node"), ("Deployment", f"{FULLNAME}-vllm")):
        spec, _ = container(objects, kind, name)
        assert spec.get("hostPID", False) == shared and spec.get("hostNetwork", False) == shared


# --- the router and vLLM -----------------------------------------------------------------------------

def test_router_command_is_one_kvpool_accepts(objects, variant):
    values = merged_values(variant)
    _, c = container(objects, "Deployment", f"{FULLNAME}-router")
    args = parse_kvpool(expand(c))
    assert args.command == "router"
    assert (args.host, args.port, args.policy, args.pooled) == ("0.0.0.0", port(c, "http"), values["router"]["policy"], True)
    assert args.backend == (values["router"]["backends"] or [f"http://{FULLNAME}-vllm{SUFFIX}:8000"])


def test_vllm_uses_the_config_kvpool_connector_config_prints(objects, variant, capsys):
    values = merged_values(variant)
    spec, c = container(objects, "Deployment", f"{FULLNAME}-vllm")
    argv = expand(c)
    assert argv[:3] == ["vllm", "serve", values["vllm"]["model"]]
    rendered = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    cli = ["connector-config", "--master", master_address(variant)]
    if values["auth"]["enabled"]:
        cli += ["--set", "credential=/etc/kvpool/tenant/tenant.cred"]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/kvpool/tenant")
        secret = next(v for v in spec["volumes"] if v["name"] == mount["name"])["secret"]
        assert secret["secretName"] == values["vllm"]["tenantSecret"]["name"]
        assert secret["items"] == [{"key": values["vllm"]["tenantSecret"]["key"], "path": "tenant.cred"}]
    for key, value in values["vllm"]["connectorExtraConfig"].items():
        cli += ["--set", f"{key}={json.dumps(value)}"]
    args = build_parser(only="connector-config").parse_args(cli)
    capsys.readouterr()
    assert args._run(args) == 0
    assert rendered == json.loads(capsys.readouterr().out)
    from kvpool.connector.config import ConnectorConfig

    ConnectorConfig.from_extra_config(rendered["kv_connector_extra_config"])  # what the connector will parse
    assert argv[argv.index("--port") + 1] == str(port(c, "http"))
    assert argv[len(argv) - len(values["vllm"]["extraArgs"]):] == values["vllm"]["extraArgs"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == values["vllm"]["gpus"]
    shm = next(v for v in spec["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"


# --- metrics -----------------------------------------------------------------------------------------

def test_service_monitor(objects, variant):
    values = merged_values(variant)
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    if not values["metrics"]["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    (sm,) = monitors
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert values["metrics"]["serviceMonitor"]["labels"].items() <= sm["metadata"]["labels"].items()
    spec = sm["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = [o for o in objects if o["kind"] == "Service"
                and spec["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()]
    scraped = {o["metadata"]["name"] for o in selected}
    assert scraped == {f"{FULLNAME}-{c}" for c in ("master-metrics", "node-metrics", "router", "vllm")}
    endpoint_ports = set()
    for endpoint in spec["endpoints"]:
        assert set(endpoint) == {"port", "path", "interval"}
        assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+[smh]", endpoint["interval"])
        endpoint_ports.add(endpoint["port"])
    for svc in selected:  # each scraped Service exposes a port one of the endpoints names
        assert endpoint_ports & {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]


def test_dashboard_configmap_is_the_documented_dashboard(objects):
    docs = ROOT / "docs/operations/grafana-dashboard.json"
    shipped = CHART / "files/grafana-dashboard.json"
    assert shipped.read_bytes() == docs.read_bytes(), "the chart's dashboard and the docs' must be the same file"
    cm = find(objects, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvpool.json"]) == json.loads(docs.read_text())


def test_dashboard_has_the_operators_panels():
    """Hit rate, fill, evictions, lookup and load latency, checksum misses and node health, each
    on a panel (that the names exist is tests/unit/test_dashboard_metrics.py's job)."""
    dashboard = json.loads((CHART / "files/grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for needed in ("kvpool_master_hit_keys_total", "kvpool_master_miss_keys_total", "kvpool_master_used_bytes",
                   "kvpool_master_capacity_bytes", "kvpool_master_evictions_total",
                   "vllm:kvpool_lookup_seconds_bucket", "vllm:kvpool_load_seconds_bucket",
                   "kvpool_client_checksum_mismatches_total", "kvpool_master_node_heartbeat_age_seconds",
                   "kvpool_node_heartbeats_total"):
        assert needed in exprs, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))

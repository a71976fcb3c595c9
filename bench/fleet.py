"""N llamaserve replicas and vllm-router in front of them, on loopback ports: the quickest
way to try a fleet on one machine (`make replicas`).

    python -m bench.fleet --replicas 2 --port 8000 --threads 1 [-- serve flags]

Replica i listens on port + i, the router on `port` (its Prometheus metrics on port + 100).
Ctrl-C or SIGTERM stops the router first, then drains the replicas. On one machine the
replicas share its cores: replication adds fault tolerance and cache-aware routing, not
compute.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.servers import wait_healthy

ROOT = Path(__file__).resolve().parent.parent
ROUTER = ROOT / ".venv-router" / "bin" / "vllm-router"


def replica_command(port: int, threads: int, serve_args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "server.startup.cli", "serve", "--port", str(port),
        "--threads", str(threads), *serve_args,
    ]  # fmt: skip


def router_command(
    port: int, workers: list[str], policy: str, metrics_port: int, health_interval_s: int = 2
) -> list[str]:
    return [
        str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--worker-urls", *workers, "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        # A replica that stops answering leaves the rotation after two failed checks, and
        # one that answers again rejoins after one.
        "--health-check-interval-secs", str(health_interval_s),
        "--health-failure-threshold", "2", "--health-success-threshold", "1",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--policy", default="cache_aware", help="vllm-router --policy")
    p.add_argument("serve_args", nargs="*", help="after --: flags for every `llamaserve serve`")
    args = p.parse_args(argv)
    if not ROUTER.exists():
        raise SystemExit(f"{ROUTER} is missing: `make replicas` installs vllm-router there")
    replicas: list[subprocess.Popen] = []
    router = None

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        urls = []
        for i in range(1, args.replicas + 1):
            port = args.port + i
            replicas.append(subprocess.Popen(replica_command(port, args.threads, args.serve_args)))
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, replicas, strict=True):
            wait_healthy(url, process)
        metrics_port = args.port + 100
        router = subprocess.Popen(router_command(args.port, urls, args.policy, metrics_port))
        wait_healthy(f"http://127.0.0.1:{args.port}", router)
        print(
            f"router http://127.0.0.1:{args.port}/v1 ({args.policy}) in front of "
            f"{', '.join(urls)}; router metrics http://127.0.0.1:{metrics_port}/metrics",
            flush=True,
        )
        while router.poll() is None and all(r.poll() is None for r in replicas):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for process in ([router] if router else []) + replicas:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in ([router] if router else []) + replicas:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    sys.exit(main())

"""Keeps vllm-router's worker list equal to the replicas Docker's DNS knows, for
deploy/compose.replicas.yml.

With `docker compose up --scale llamaserve=N` every replica answers to the service name
`llamaserve` (one DNS A record per running container), but no fixed URL names replica i,
and a restarted container may come back on another address. vllm-router's own service
discovery reads the Kubernetes API only, so under compose this loop does its job: every
few seconds it resolves the service name and makes the router's workers match, through
the router's worker API (GET /list_workers, POST /add_worker, POST /remove_worker).

    python discover.py --router http://router:8000 --service llamaserve --port 8000

It only edits the router's list; the router health-checks and retries on its own. The
standard library only: it runs in the router's image.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("discover")


def resolve(service: str, port: int) -> set[str]:
    """Worker URLs of every address the service name resolves to (none while it has no
    running container: Docker's DNS then answers NXDOMAIN)."""
    try:
        infos = socket.getaddrinfo(service, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return set()
    return {f"http://{info[4][0]}:{port}" for info in infos}


def router_workers(router: str, timeout_s: float) -> set[str]:
    with urllib.request.urlopen(f"{router}/list_workers", timeout=timeout_s) as response:
        return set(json.load(response)["urls"])


def change_worker(router: str, action: str, url: str, timeout_s: float) -> bool:
    """POST /add_worker or /remove_worker. The router answers an add only once the worker's
    /health is 200 (or its --worker-startup-timeout-secs ran out: then the next round tries
    again), so a replica still loading its model joins when it is ready."""
    query = urllib.parse.urlencode({"url": url})
    request = urllib.request.Request(f"{router}/{action}?{query}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            log.info("%s %s", action, url)
            return True
    except (urllib.error.URLError, TimeoutError) as e:
        log.warning("%s %s failed: %s", action, url, e)
        return False


def reconcile(
    router: str, wanted: set[str], pool: ThreadPoolExecutor, timeout_s: float
) -> tuple[list[str], list[str]]:
    """One round: add the replicas the router lacks (in parallel, since each add may wait
    for a replica to become healthy), remove those DNS no longer lists. Returns what was
    added and removed."""
    current = router_workers(router, timeout_s)
    missing, gone = sorted(wanted - current), sorted(current - wanted)
    added = pool.map(lambda url: change_worker(router, "add_worker", url, timeout_s), missing)
    added = [url for url, ok in zip(missing, added, strict=True) if ok]
    removed = [url for url in gone if change_worker(router, "remove_worker", url, timeout_s)]
    return added, removed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="http://router:8000", help="the router's base URL")
    p.add_argument("--service", default="llamaserve", help="compose service of the replicas")
    p.add_argument("--port", type=int, default=8000, help="port the replicas listen on")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between rounds")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one router call may take")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with ThreadPoolExecutor(max_workers=16) as pool:
        while True:
            try:
                reconcile(args.router, resolve(args.service, args.port), pool, args.timeout)
            except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
                log.warning("router %s not reachable yet: %s", args.router, e)
            time.sleep(args.interval)


if __name__ == "__main__":
    main()

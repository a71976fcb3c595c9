"""One model's own `llamaserve serve` process on a loopback port: started, waited for until
/health answers, watched, stopped.

A process per model, as llama.cpp's router runs them: unloading a model is ending its
process, so all of its memory goes back to the system (a Python process keeps much of
what it freed), and a crash, a killed engine or a file that fails to load ends only that
process. The child listens on 127.0.0.1 and wants a key only the front knows, passed in
its environment, so nothing else on the machine can use it past the front's own checks.
Its log lines go to the front's stderr, each prefixed with the model's name; the last
ones are kept to say why it failed.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Sequence

import httpx

logger = logging.getLogger("llamaserve.models")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the front dies, even by
    SIGKILL, so no model process outlives the server that started it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ChildFailed(Exception):
    """The process exited or never became healthy; the message says why."""


class ModelProcess:
    def __init__(self, name: str, argv: Sequence[str]) -> None:
        self.name = name
        self.argv = list(argv)  # `serve MODEL ...flags`, without host, port and key
        self.port = free_port()
        self.key = secrets.token_urlsafe(24)
        self.process: asyncio.subprocess.Process | None = None
        self.stopping = False
        self.log_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._reader: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    async def start(self, timeout_s: float) -> None:
        command = [sys.executable, "-m", "server.startup.cli", *self.argv]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, "LLAMASERVE_API_KEY": self.key}
        self.process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._reader = asyncio.create_task(self._echo_log())
        await self._wait_healthy(timeout_s)

    async def _echo_log(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.log_tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process is None or self.process.returncode is not None:
                    raise ChildFailed(await self.exit_reason())
                try:
                    if (await client.get(f"{self.base_url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        await self.stop(grace_s=2.0)
        raise ChildFailed(f"its process did not become healthy in {timeout_s:.0f} s")

    async def exit_reason(self) -> str:
        """Why the process ended: the last line it printed that says so, and its exit."""
        code = await self.process.wait() if self.process is not None else None
        if self._reader is not None:
            await asyncio.wait([self._reader], timeout=2.0)
        said = [line for line in self.log_tail if line.startswith("llamaserve: ")]
        if code is not None and code < 0:
            how = f"its process was killed by {signal.Signals(-code).name}"
        else:
            how = f"its process exited with code {code}"
        return f"{said[-1].removeprefix('llamaserve: ')} ({how})" if said else how

    async def stop(self, grace_s: float) -> None:
        """SIGTERM (the server drains), then SIGKILL after `grace_s`."""
        self.stopping = True
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            logger.warning(
                "model %s: its process did not stop in %.0f s; killed", self.name, grace_s
            )
            process.kill()
            await process.wait()

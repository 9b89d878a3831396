"""Start / stop a local OpenAI-compatible server as a subprocess (for `compare` and tests).

The bench never imports the server: it runs a command line (default: `flashlane serve`) and talks
to it over HTTP. The process is always stopped: on normal exit, errors and Ctrl-C.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

FLASHLANE_SERVE = [sys.executable, "-c", "import sys; from flashlane.cli.main import main; sys.exit(main())",
                   "serve"]


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, template: str | None = None,
                  extra_args: list[str] | None = None) -> list[str]:
    """`flashlane serve --model M --host 127.0.0.1 --port P [extra]`, or a user template with
    {model}, {port}, {host} and {python} placeholders."""
    if template:
        return shlex.split(template.format(model=model, port=port, host="127.0.0.1",
                                           python=sys.executable))
    return FLASHLANE_SERVE + ["--model", model, "--host", "127.0.0.1", "--port", str(port)] + list(extra_args or [])


class ServerProcess:
    def __init__(self, command: list[str], base_url: str, log_path: Path,
                 startup_timeout_s: float = 300.0):
        self.command, self.base_url, self.log_path = command, base_url.rstrip("/"), Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        # Own process group, so stopping it also stops any worker processes it forks. The bench
        # sends no API key, so a key exported for `flashlane serve` must not lock out its own servers.
        env = {k: v for k, v in os.environ.items() if k != "FLASHLANE_API_KEY"}
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self.proc.returncode} before becoming healthy: "
                    f"{shlex.join(self.command)}\n--- log tail ---\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise ServerStartError(f"server not healthy after {self.startup_timeout_s:.0f}s: "
                               f"{shlex.join(self.command)}\n--- log tail ---\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

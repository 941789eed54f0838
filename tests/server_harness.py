"""Run a real uvicorn server in a background thread on a free loopback port."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

HOST = "127.0.0.1"


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    return sock


def free_port() -> int:
    with free_socket() as sock:
        return int(sock.getsockname()[1])


class ServerThread:
    """uvicorn on a socket bound here (no port race), in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.sock = free_socket()
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://{HOST}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one Prometheus series in /metrics text (None when absent)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


# ---- `tokenmill serve` as a subprocess -------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


def start_server(tmp_path: Path, *args: str) -> Server:
    """`tokenmill serve` on the default model (float32, 64 MiB of KV) as a subprocess
    on a free port, once /health answers; its output goes to tmp_path/serve.log."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "serve", "--host", HOST, "--port", str(port),
             "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        )
    server = Server(process, url, log_path)
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, server.log()
        assert time.monotonic() < deadline, "the server did not come up\n" + server.log()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)

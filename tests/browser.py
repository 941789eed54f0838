"""Headless Chromium driven over the DevTools protocol (a websocket), for tests
that load a page in a real browser: evaluate JavaScript, collect the console's
errors, take screenshots. Debian's `chromium` package (`make setup` installs it
when run as root)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx
from websockets.sync.client import ClientConnection, connect

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class Page:
    """One tab. Events that arrive while waiting for a reply are kept; console
    errors, uncaught exceptions and the browser log's errors go to `errors`."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.errors: list[str] = []
        self.console: list[str] = []

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result
            self._event(message)

    def pump(self, seconds: float) -> None:
        """Read events for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._event(json.loads(self.ws.recv(timeout=left)))
            except TimeoutError:
                return

    def _event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                self.errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            description = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"uncaught exception: {description}")
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") == "error":
                self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")

    def navigate(self, url: str, width: int = 1400, height: int = 1000) -> None:
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


class Chromium:
    """`with Chromium() as browser: page = browser.page()`: a headless browser in
    its own profile directory, on a DevTools port it picks itself."""

    def __init__(self, executable: str | None = None) -> None:
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise FileNotFoundError("no Chromium found (apt-get install -y chromium)")
        self.profile = tempfile.TemporaryDirectory(prefix="tokenmill-chromium-")
        self.process: subprocess.Popen[bytes] | None = None
        self.sockets = contextlib.ExitStack()

    def __enter__(self) -> Chromium:
        assert self.executable is not None
        log_path = Path(self.profile.name) / "chromium.log"
        with log_path.open("wb") as log:  # (a file, not a pipe: a full pipe would stall it)
            self.process = self._launch(log)
        port_file = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log_text = log_path.read_text(errors="replace")[-2000:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"Chromium did not start its DevTools server:\n{log_text}")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        return self

    def _launch(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        assert self.executable is not None
        return subprocess.Popen(
            [self.executable, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile.name}", "about:blank"],
            stdout=log, stderr=subprocess.STDOUT,
        )

    def page(self) -> Page:
        targets = httpx.get(f"http://127.0.0.1:{self.port}/json/list", timeout=10).json()
        target = next(t for t in targets if t["type"] == "page")
        ws = self.sockets.enter_context(
            connect(target["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=10))
        return Page(ws)

    def __exit__(self, *_: object) -> None:
        with contextlib.suppress(Exception):
            self.sockets.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.profile.cleanup()

"""Load a page in real headless Chromium over the DevTools protocol, for the HTML report's render tests.

``load_page`` starts Debian's ``chromium --headless --no-sandbox`` on a free DevTools port, opens the file, waits
for its load event, evaluates a few JavaScript expressions in it, and returns what the page did: console messages,
uncaught exceptions, log entries (CSP violations and failed loads among them) and every URL it requested.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Chromium starts in 1-2 s on a quiet 2-core VM; once, on a fresh clone's suite with both test workers training, it
# opened no page within 30 s. Its start forks a zygote and helper processes, each waiting for a core there.
START_TIMEOUT_S = 90.0


def find_chromium() -> str | None:
    """The Chromium executable on PATH (Debian names it ``chromium``), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageLoad:
    """What a page did while it loaded, and the values of the expressions evaluated after."""

    console: list[str] = field(default_factory=list)  # every console.* call: "type: text"
    errors: list[str] = field(default_factory=list)  # uncaught exceptions and error-level log entries
    requests: list[str] = field(default_factory=list)  # URLs the page asked for, itself first
    values: dict[str, Any] = field(default_factory=dict)


class _DevTools:
    """A minimal CDP client: numbered commands, events collected while waiting for a command's answer."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import websocket  # websocket-client (the dev extra); imported here so the other report tests run without it

        # Chromium refuses DevTools connections that carry an Origin header unless told to allow it.
        self.ws = websocket.create_connection(url, timeout=timeout_s, suppress_origin=True)
        self.events: list[dict[str, Any]] = []
        self.serial = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.serial += 1
        self.ws.send(json.dumps({"id": self.serial, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.serial:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == method for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout_s} s")
            self.events.append(json.loads(self.ws.recv()))

    def close(self) -> None:
        self.ws.close()


def load_page(path: Path, expressions: dict[str, str], timeout_s: float = 30.0) -> PageLoad:
    """Open ``path`` (a local file) in headless Chromium and evaluate ``expressions`` (name → JavaScript) once
    it has loaded; their values come back by value (JSON)."""
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError("chromium is not installed")
    # Chromium's helpers may still write to the profile for a moment after the browser exits.
    with tempfile.TemporaryDirectory(prefix="stepscope-chromium-", ignore_cleanup_errors=True) as profile:
        cmd = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
            "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank",
        ]  # fmt: skip
        # Its own session, so that the browser and the helper processes it forks end together.
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            devtools = _DevTools(_page_socket(Path(profile), proc), timeout_s)
            try:
                return _load(devtools, path.resolve().as_uri(), expressions, timeout_s)
            finally:
                devtools.close()
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End the browser's process group (SIGTERM, then SIGKILL after 10 s)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _page_socket(profile: Path, proc: subprocess.Popen) -> str:
    """The DevTools WebSocket of the browser's first page; Chromium writes its port to DevToolsActivePort."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with code {proc.returncode} before opening DevTools")
        if port_file.exists() and port_file.read_text().strip():
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as answer:
                pages = [t for t in json.load(answer) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.1)
    raise TimeoutError(f"chromium opened no DevTools page within {START_TIMEOUT_S} s")


def _load(devtools: _DevTools, url: str, expressions: dict[str, str], timeout_s: float) -> PageLoad:
    for domain in ("Runtime", "Log", "Network", "Page"):
        devtools.call(f"{domain}.enable")
    devtools.events.clear()  # about:blank's own events
    devtools.call("Page.navigate", url=url)
    devtools.wait_for("Page.loadEventFired", timeout_s)
    load = PageLoad()
    for name, expression in expressions.items():
        result = devtools.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{name}: {result['exceptionDetails'].get('text')}")
        load.values[name] = result["result"].get("value")
    for event in devtools.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            load.console.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                load.errors.append(f"console.{params.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            load.errors.append(f"{details.get('text')} {details.get('exception', {}).get('description', '')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            load.errors.append(f"log: {params['entry'].get('text')}")
        elif method == "Network.requestWillBeSent":
            load.requests.append(params.get("request", {}).get("url", ""))
    return load

"""Headless Chromium for the page tests and the benchmark, over the DevTools protocol on a pipe.

No driver and no download: Debian's ``chromium`` (``.ci/run`` installs it) is started with
``--remote-debugging-pipe``, so the protocol's JSON messages travel on file descriptors 3 and 4
and no port is opened. :class:`Browser` opens pages (:class:`Page`) with the network switched
off, records what their consoles said and what they tried to fetch, moves a real mouse, presses
real keys and takes screenshots.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

#: Where Debian puts it; ``NEMO_MOE_METRICS_CHROMIUM`` names another.
CHROMIUM = os.environ.get("NEMO_MOE_METRICS_CHROMIUM", "/usr/bin/chromium")
#: Set to 1 (CI does) to fail, not skip, when no browser can start.
REQUIRE = "NEMO_MOE_METRICS_REQUIRE_BROWSER"
# The flags the project's machines need (root, no GPU, no network), plus no background chatter.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
)


class BrowserUnavailable(RuntimeError):
    """Chromium is not installed here, or did not start."""


def chromium_path() -> str:
    """The Chromium executable; :class:`BrowserUnavailable` when there is none."""
    found = shutil.which(CHROMIUM) or (CHROMIUM if os.access(CHROMIUM, os.X_OK) else None)
    if not found:
        raise BrowserUnavailable(
            f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)"
        )
    return found


class Browser:
    """One headless Chromium process and its DevTools pipe."""

    def __init__(self, timeout: float = 60.0) -> None:
        exe = chromium_path()
        self.profile = Path(tempfile.mkdtemp(prefix="nmm_chromium_"))
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()

        def wire() -> None:  # in the child: Chromium reads fd 3 and writes fd 4
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)

        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe"],
            pass_fds=(3, 4),
            preexec_fn=wire,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_r)
        os.close(from_w)
        self._out = os.fdopen(to_w, "wb", buffering=0)
        self._in = os.fdopen(from_r, "rb", buffering=0)
        self._buf = b""
        self._id = 0
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []
        try:
            self.version = self.call("Browser.getVersion")["product"]
        except Exception as err:
            self.close()
            raise BrowserUnavailable(f"Chromium ({exe}) did not answer: {err}") from err

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and wait for its answer; events meanwhile go to :attr:`events`."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self._out.write(json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
                self.events.append(reply)
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise BrowserUnavailable(f"no answer to {method} (browser exited or hung)")
            if not select.select([self._in], [], [], min(left, 1.0))[0]:
                continue  # nothing yet: look at the clock and the process again
            chunk = self._in.read(1 << 20)
            if not chunk:
                raise BrowserUnavailable(f"the browser closed its pipe during {method}")
            self._buf += chunk

    def new_page(self, width: int = 1400, height: int = 1000) -> Page:
        """A fresh tab (its own browser context) with the network off."""
        context = self.call("Target.createBrowserContext")["browserContextId"]
        target = self.call(
            "Target.createTarget", {"url": "about:blank", "browserContextId": context}
        )["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        return Page(self, session, target, context, width, height)

    def close(self) -> None:
        """Stop the browser (its process only) and delete its profile."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self._out, self._in):
            f.close()
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab: load a file, evaluate JavaScript, mouse and keys, console and requests."""

    def __init__(self, browser: Browser, session: str, target: str, context: str, w: int, h: int):
        self.b, self.session, self.target, self.context = browser, session, target, context
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call(
            "Network.emulateNetworkConditions",
            {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
        )
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False},
        )
        self.mark = len(browser.events)

    def call(self, method: str, params: dict | None = None) -> dict:
        """A DevTools command in this tab."""
        return self.b.call(method, params, self.session)

    def open(self, path: Path) -> float:
        """Navigate to ``path`` as a file URL; seconds until the load event."""
        started = time.perf_counter()
        self.call("Page.navigate", {"url": Path(path).resolve().as_uri()})
        self.wait_for("document.readyState === 'complete'")
        return time.perf_counter() - started

    def eval(self, expression: str, await_promise: bool = False) -> Any:
        """The value of a JavaScript expression in the page (JSON-able values)."""
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": await_promise},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll until ``expression`` is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s: {expression}")
            time.sleep(0.02)

    def mouse_move(self, x: float, y: float) -> None:
        """Move the mouse to page pixel ``(x, y)`` (a real input event, as a user's)."""
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def click(self, x: float, y: float) -> None:
        """Press and release the left button at ``(x, y)``."""
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1},
            )

    def press(self, key: str, code: int) -> None:
        """Press and release one key (``"ArrowLeft"``, 37) in the focused element."""
        for kind in ("rawKeyDown", "keyUp"):
            self.call(
                "Input.dispatchKeyEvent",
                {"type": kind, "key": key, "code": key, "windowsVirtualKeyCode": code},
            )

    def screenshot(self, path: Path) -> Path:
        """The whole page as a PNG at ``path``."""
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        Path(path).write_bytes(base64.b64decode(shot["data"]))
        return Path(path)

    def _mine(self) -> list[dict[str, Any]]:
        return [e for e in self.b.events[self.mark :] if e.get("sessionId") == self.session]

    def console_errors(self) -> list[str]:
        """Errors the page raised or logged (uncaught exceptions, console.error, failed
        loads, CSP violations), as text."""
        out = []
        for e in self._mine():
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                out.append(str(details.get("exception", {}).get("description") or details))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                out.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
                )
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                out.append(params["entry"].get("text", ""))
        return out

    def requests(self) -> list[str]:
        """Every URL the page asked for (its own file and ``data:`` URLs included)."""
        return [
            e["params"]["request"]["url"]
            for e in self._mine()
            if e.get("method") == "Network.requestWillBeSent"
        ]

    def close(self) -> None:
        """Close the tab and its browser context."""
        self.b.call("Target.closeTarget", {"targetId": self.target})
        self.b.call("Target.disposeBrowserContext", {"browserContextId": self.context})

"""A headless Chromium driven over the DevTools protocol, for the dashboard benchmarks.

``with browser(profile) as page:`` starts Chromium (Debian's ``chromium``) with one blank page
and yields a :class:`Page` (None when Chromium or the ``websockets`` package is missing, so
that a benchmark can report the figure as not measured instead of failing). The tests keep
their own client (``tests/test_dashboard.py``): they fail, where this reports.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Page:
    """The few DevTools calls the benchmarks need, over one page's websocket."""

    def __init__(self, ws: Any, timeout: float = 30.0) -> None:
        self.ws, self.timeout, self.next_id = ws, timeout, 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=self.timeout))
            if reply.get("id") == self.next_id:
                return dict(reply.get("result", {}))

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (None when it throws)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@contextlib.contextmanager
def browser(profile: Path, window: str = "1400,1700") -> Iterator[Page | None]:
    try:
        from websockets.sync.client import connect
    except ImportError:
        yield None
        return
    chromium = shutil.which("chromium")
    if chromium is None:
        yield None
        return
    args = [chromium, "--headless", "--disable-gpu", "--remote-debugging-port=0"]
    args += [f"--user-data-dir={profile}", f"--window-size={window}", "about:blank"]
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium's sandbox refuses to run as root
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline:
                yield None
                return
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        target = next(t for t in targets if t["type"] == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=2**26) as ws:
            yield Page(ws)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()

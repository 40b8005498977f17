"""The dashboard's web app (Starlette) and how it is served (uvicorn).

It reads the run folder on every request: ``/`` the page,
``/api/fleet`` (``fleet.json``), ``/api/rounds`` (``metrics.jsonl``'s rows),
``/api/summary`` (``summary.json`` once the run has ended), ``/api/batteries`` (the batteries'
history, ``batteries.jsonl``: the fleet's mean, lowest and highest per round, and the series of
the devices named by ``?device=``, six at most), ``/events`` (server-sent events:
one each time either file changes, so the page refreshes itself), ``/metrics`` (Prometheus).
What it answers is made again only when the files' bytes change (a page open on a fleet of
1,000 devices, and Prometheus, ask every few seconds; a round lands far less often), and made
in a worker thread, so that one slow render never holds up the event streams.

The page shows device ids and rejection reasons, which devices chose: it is bound to
127.0.0.1 unless a token is given (:func:`check_bind`), and with a token every request must
carry it (``Authorization: Bearer TOKEN``, or ``?token=TOKEN`` once, which sets a cookie
holding a value derived from the token, never the token itself: :func:`session_value`).
Without a token it answers only requests addressed to a loopback name, so that a web page
elsewhere cannot read it through DNS rebinding.

Everything before the token check is bounded (``docs/reference/service-limits.md``): uvicorn's
h11 parser with a cap on an unfinished request head (its httptools parser buffers a header
without limit), a deadline for the head (:class:`BoundedH11Protocol`), and a cap on open
connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from edgefleet.dashboard import metrics
from edgefleet.dashboard.data import (
    BATTERIES,
    FLEET,
    ROUNDS,
    ContentCache,
    battery_stats,
    latest_run,
    parse_batteries,
    parse_fleet,
    parse_rounds,
    signature,
)
from edgefleet.fileio import read_regular

STATIC = Path(__file__).parent / "static"
TOKEN_ENV = "EDGEFLEET_DASHBOARD_TOKEN"
COOKIE = "edgefleet_dashboard"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050
MAX_DEVICE_SERIES = 6  # devices whose own battery series one request may ask for
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
# Before the token check: what one unauthenticated client can make the server hold.
MAX_REQUEST_HEAD = 16 * 1024  # bytes of an unfinished request line + headers (h11)
HEADER_TIMEOUT_S = 10.0  # seconds from a connection's start (or its last answer) to a request
MAX_CONNECTIONS = 256  # open connections, event streams included; over it: 503
# The proxy whose X-Forwarded-Proto says the page was reached over TLS (uvicorn's default).
TRUSTED_PROXIES = "127.0.0.1"
SESSION_LABEL = b"edgefleet-dashboard-session-v1"
# Scripts and styles from the package only: a string that slipped into the page as markup
# would still not run.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class DashboardError(Exception):
    """The dashboard cannot start as asked (the message says why and what to do)."""


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve the fleet beyond this machine without a token."""
    if not is_loopback(host) and not token:
        raise DashboardError(
            f"--host {host} would show the fleet's device ids to the network without a "
            f"password: pass --token TOKEN (or set {TOKEN_ENV}), or keep the default "
            f"--host {DEFAULT_HOST} (this machine only)"
        )


def create_app(
    run_dir: Path | str,
    token: str | None = None,
    *,
    events_max_s: float = 300.0,
    poll_s: float = 1.0,
    latest: bool = False,
    static: Path = STATIC,
    metrics_max_devices: int = metrics.MAX_DEVICES,
    metrics_offline_rounds: int = metrics.OFFLINE_ROUNDS,
) -> Starlette:
    """The dashboard of ``run_dir``; with ``latest``, of the run folder under ``run_dir``
    written to last (:func:`~edgefleet.dashboard.data.latest_run`), looked up on every
    request. ``events_max_s`` ends each event stream after that long (the browser reconnects
    by itself), so that a stopping server never waits on it long. ``static``: the page's
    files (``benchmarks/perf/dashboard_scale.py --baseline`` serves an older page's).
    ``metrics_max_devices``, ``metrics_offline_rounds``: which devices ``/metrics`` exports
    (:func:`~edgefleet.dashboard.metrics.exported_devices`)."""
    base = Path(run_dir)

    def folder() -> Path | None:
        return latest_run(base) if latest else base

    def current() -> Path:
        # While no run has written anything yet, the parent reads as an empty run.
        return folder() or base

    async def page(request: Request) -> Response:
        return FileResponse(static / "index.html", headers={"Cache-Control": "no-store"})

    cache = ContentCache()

    def json_body(raw: bytes | None, parse: Callable[[bytes | None], Any]) -> bytes:
        return bytes(JSONResponse(js_safe(parse(raw))).body)

    async def fleet(request: Request) -> Response:
        body = await run_in_threadpool(
            cache.get, "fleet", current(), (FLEET,), lambda raw: json_body(raw, parse_fleet)
        )
        return _json_bytes(body)

    async def rounds(request: Request) -> Response:
        body = await run_in_threadpool(
            cache.get, "rounds", current(), (ROUNDS,), lambda raw: json_body(raw, parse_rounds)
        )
        return _json_bytes(body)

    def battery_history(raw: bytes | None) -> tuple[dict[int, dict[str, float]], Any]:
        by_round = parse_batteries(raw)
        return by_round, battery_stats(by_round)

    async def batteries(request: Request) -> Response:
        by_round, stats = await run_in_threadpool(
            cache.get, "batteries", current(), (BATTERIES,), battery_history
        )
        asked = list(dict.fromkeys(request.query_params.getlist("device")))[:MAX_DEVICE_SERIES]
        devices = {d: [levels.get(d) for levels in by_round.values()] for d in asked}
        return _json({**stats, "devices": devices})

    async def summary(request: Request) -> Response:
        run_dir = folder()
        if run_dir is None:
            return _json({"run": "", "summary": {}})
        try:
            data = json.loads(read_regular(run_dir / "summary.json"))
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            data.pop("config", None)  # long, and the page does not show it
        else:
            data = {}
        return _json({"run": run_dir.name, "summary": data})

    async def exposition(request: Request) -> Response:
        body = await run_in_threadpool(
            cache.get,
            "metrics",
            current(),
            (FLEET, ROUNDS),
            lambda f, r: metrics.render_data(
                parse_fleet(f),
                parse_rounds(r),
                max_devices=metrics_max_devices,
                offline_rounds=metrics_offline_rounds,
            ),
        )
        return Response(body, media_type=metrics.CONTENT_TYPE)

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            yield "retry: 2000\n\n"
            last, idle = None, 0.0
            deadline = time.monotonic() + events_max_s
            while True:
                run_dir = current()
                now = f"{run_dir.name}/{signature(run_dir)}"  # a new run is a change too
                if now != last:
                    last, idle = now, 0.0
                    yield f"event: change\ndata: {json.dumps(now)}\n\n"
                elif idle >= 15.0:  # a comment keeps proxies from closing an idle stream
                    idle = 0.0
                    yield ": idle\n\n"
                if time.monotonic() >= deadline or await request.is_disconnected():
                    return
                await asyncio.sleep(poll_s)
                idle += poll_s

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    routes = [
        Route("/", page),
        Route("/api/fleet", fleet),
        Route("/api/rounds", rounds),
        Route("/api/summary", summary),
        Route("/api/batteries", batteries),
        Route("/events", events),
        Route("/metrics", exposition),
        Mount("/static", StaticFiles(directory=static), name="static"),
    ]
    guard = _Guard(token or None)
    return Starlette(routes=routes, middleware=[Middleware(BaseHTTPMiddleware, dispatch=guard)])


# The largest integer a JavaScript number holds exactly. Flower's node ids are 64-bit: sent
# as numbers, 6004891191586305998 reached the page as 6004891191586306000.
JS_SAFE_INT = 2**53 - 1


def js_safe(data: Any) -> Any:
    """``data`` with every integer a JavaScript number cannot hold exactly as a string."""
    if isinstance(data, bool):
        return data
    if isinstance(data, int):
        return str(data) if abs(data) > JS_SAFE_INT else data
    if isinstance(data, dict):
        return {k: js_safe(v) for k, v in data.items()}
    if isinstance(data, list):
        return [js_safe(v) for v in data]
    return data


def _json(data: Any) -> Response:
    return JSONResponse(js_safe(data), headers={"Cache-Control": "no-store"})


def _json_bytes(body: bytes) -> Response:
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


class _Guard:
    """Authentication and the security headers of every response."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.session = session_value(token) if token is not None else ""

    async def __call__(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await self._check(request, call_next)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response

    async def _check(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if self.token is None:
            if not is_loopback(request.url.hostname or ""):
                return PlainTextResponse(
                    "this dashboard answers only on a loopback address (no token is set)",
                    status_code=403,
                )
            return await call_next(request)
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._ok(bearer.strip()):
            return await call_next(request)
        if _same(request.cookies.get(COOKIE, ""), self.session):
            return await call_next(request)
        if self._ok(request.query_params.get("token", "")):
            # The token leaves the address bar (and the history) at once; the cookie carries
            # a value derived from it, so a cookie read off a disk is not the password.
            target = request.url.remove_query_params("token")
            response: Response = RedirectResponse(
                local_path(target.path) + (f"?{target.query}" if target.query else ""), 303
            )
            response.set_cookie(
                COOKIE,
                self.session,
                httponly=True,
                samesite="strict",
                # Behind TLS (uvicorn reads X-Forwarded-Proto from a trusted proxy into the
                # scheme), the browser must never send it over plain HTTP.
                secure=request.url.scheme == "https",
            )
            return response
        return PlainTextResponse(
            "401: this dashboard needs its token (Authorization: Bearer TOKEN, or open "
            "/?token=TOKEN once)",
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="edgefleet"'},
        )

    def _ok(self, given: str) -> bool:
        assert self.token is not None
        return _same(given, self.token)


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison (a timing difference would reveal the value byte by byte)."""
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def session_value(token: str) -> str:
    """The cookie's value: an HMAC of a fixed label keyed by the token. It admits the holder
    as the token does, but a copy of the cookie (a browser profile, a proxy's log) does not
    reveal the password, which may be used elsewhere (Prometheus' scrape config)."""
    return hmac.new(token.encode(), SESSION_LABEL, hashlib.sha256).hexdigest()


def local_path(path: str) -> str:
    """``path`` as a path on this site, whatever it holds: one leading slash, and every
    character a browser could read as a scheme, a host or a break (``\\``, tabs, newlines)
    percent-encoded, so ``//evil.example/`` or ``/\\evil`` redirect here, not there."""
    return "/" + quote(path, safe="/:@!$&'()*+,;=-._~").lstrip("/")


def token_from(arg: str | None) -> str | None:
    """``--token``, else ``$EDGEFLEET_DASHBOARD_TOKEN``, else none."""
    return arg or os.environ.get(TOKEN_ENV) or None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), or a clear error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise DashboardError(f"--host {host}: not an address of this machine ({err})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise DashboardError(
            f"cannot listen on {host}:{port}: {err.strerror} (another --port, or 0 for any free "
            "one)"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    if host in ("0.0.0.0", "[::]"):
        host = socket.gethostname()
    return f"http://{host}:{port}/"


def bounded_h11(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, with a deadline for each request's head: a connection that has
    not sent a whole request line and headers ``header_timeout_s`` after it opened (or after
    its last answer) is closed. uvicorn has no such timeout of its own (its keep-alive timer
    stops at the first byte), so a client sending a byte a second would hold a connection,
    and with :data:`MAX_CONNECTIONS` of them the dashboard, forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            self._arm()  # first: a pipelined request handled below disarms it again
            super().on_response_complete()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a whole request head arrived
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return BoundedH11Protocol


class Dashboard:
    """A dashboard served by uvicorn: :meth:`serve` in the foreground, or :meth:`start` in
    a thread beside a run and :meth:`stop` at its end.

    ``max_connections``, ``header_timeout_s`` and ``max_request_head`` bound what clients
    that have not shown the token yet can make it hold; ``trusted_proxies``: the addresses
    (comma-separated, ``*`` any) whose ``X-Forwarded-Proto`` is believed, so that behind a
    TLS proxy the cookie is ``Secure``; ``metrics_max_devices``, ``metrics_offline_rounds``:
    which devices ``/metrics`` exports."""

    def __init__(
        self,
        run_dir: Path | str,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        token: str | None = None,
        *,
        events_max_s: float = 300.0,
        latest: bool = False,
        static: Path = STATIC,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_request_head: int = MAX_REQUEST_HEAD,
        trusted_proxies: str = TRUSTED_PROXIES,
        metrics_max_devices: int = metrics.MAX_DEVICES,
        metrics_offline_rounds: int = metrics.OFFLINE_ROUNDS,
    ) -> None:
        import uvicorn

        check_bind(host, token)
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        app = create_app(
            run_dir,
            token,
            events_max_s=events_max_s,
            latest=latest,
            static=static,
            metrics_max_devices=metrics_max_devices,
            metrics_offline_rounds=metrics_offline_rounds,
        )
        config = uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=2,
            access_log=False,
            # h11, not httptools (uvicorn's pick when installed): httptools buffers an
            # unfinished header without limit, before the app (and its token check) runs.
            http=bounded_h11(header_timeout_s),
            h11_max_incomplete_event_size=max_request_head,
            limit_concurrency=max_connections,
            ws="none",  # the dashboard has no websocket route
            proxy_headers=True,
            forwarded_allow_ips=trusted_proxies,
        )
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    def serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def start(self) -> Dashboard:
        self.thread = threading.Thread(target=self.serve, name="edgefleet-dashboard", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=5)

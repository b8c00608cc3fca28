"""A counting reverse proxy in front of the test cluster's API server, to measure what one client costs.

The operator under test gets a kubeconfig whose server is this proxy (plain HTTP on loopback); the
proxy forwards every request, streaming watches included, to the real API server over TLS and
counts it by verb and resource. Nothing is answered by the proxy itself.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import threading
from collections import Counter
from pathlib import Path

import aiohttp
from aiohttp import web

_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length"}
# /api/v1/namespaces/NS/pods/NAME, /apis/GROUP/VERSION/namespaces/NS/PLURAL/NAME/status, ...
_PATH = re.compile(
    r"^/apis?(?:/[^/]+)?/v[^/]*(?:/namespaces/[^/]+)?/(?P<resource>[^/?]+)(?:/(?P<name>[^/?]+))?"
    r"(?:/(?P<sub>[^/?]+))?"
)


def describe(method: str, path: str, query: str) -> str:
    """`VERB resource[/sub]`, with list/watch/get told apart as the API server's audit log does."""
    m = _PATH.match(path)
    resource = m["resource"] if m else path
    if m and m["sub"]:
        resource += f"/{m['sub']}"
    verb = method.lower()
    if method == "GET":
        verb = (
            "watch"
            if "watch=" in query and "watch=false" not in query
            else ("get" if m and m["name"] else "list")
        )
    return f"{verb} {resource}"


class ApiCounter:
    """Forward http://127.0.0.1:PORT to `upstream` (https, verified with `ca_file`), counting requests."""

    def __init__(self, upstream: str, ca_file: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.ssl = ssl.create_default_context(cafile=str(ca_file))
        self.counts: Counter[str] = Counter()
        self.port = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ApiCounter:
        self._thread.start()
        self._ready.wait(10)
        return self

    def reset(self) -> Counter[str]:
        with self._lock:
            seen, self.counts = self.counts, Counter()
        return seen

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def stop(self) -> None:
        """Close the open watches and the upstream session, then the loop."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        await self._session.close()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:  # requests still streaming (watches): end them before the loop stops
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.ssl),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = self._runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts[describe(request.method, request.path, request.query_string)] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body or None,
            allow_redirects=False,
            # As sent: a body without a Content-Type (the API server reads JSON) must not become octet-stream.
            skip_auto_headers=("Content-Type", "User-Agent", "Accept-Encoding"),
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP},
            )
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (ConnectionResetError, aiohttp.ClientError):  # the client closed a watch
                pass
            return response

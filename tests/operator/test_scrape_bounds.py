"""Progress scrapes against real hostile HTTP servers: a huge body, a drip, a gzip bomb, next to a normal one.

The trainer image is the CR author's choice, so its `/metrics` may be anything. The operator must
read at most `scrape.MAX_BYTES`, give up after `scrape.DEADLINE` seconds all told, and scrape
every SFTJob at once, so the normal job's progress arrives on time whatever the others do.
The Kubernetes side is a small in-memory stand-in (what is under test is the HTTP side).
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from packtrain.operator import handlers, names, progress, scrape
from packtrain.operator.api import GROUP

NORMAL = b"""# HELP packtrain_train_step Optimizer steps done.
# TYPE packtrain_train_step gauge
packtrain_train_step{rank="0"} 42.0
# TYPE packtrain_train_loss gauge
packtrain_train_loss{rank="0"} 1.5
"""
HUGE = 300 * 1024 * 1024  # the body that took the operator to 1.5 GB
_MIB = b"packtrain_train_step 1\n" * (1024 * 1024 // 23)
DRIP_EVERY = 2.0


def _write_until_closed(handler: http.server.BaseHTTPRequestHandler, total: int) -> None:
    sent = 0
    try:
        while sent < total:
            handler.wfile.write(_MIB)
            sent += len(_MIB)
    except OSError:  # the client hung up: what a bounded scrape does
        pass


def _gzip_bomb(size: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"0" * (1 << 20)
    return b"".join(packer.compress(block) for _ in range(size >> 20)) + packer.flush()


BOMB = _gzip_bomb(100 * 1024 * 1024)


class Hostile(http.server.BaseHTTPRequestHandler):
    """A trainer's /metrics as its image may serve it: one behaviour per server (a pod serves one thing)."""

    protocol_version = "HTTP/1.0"
    behaviour = ""
    lock = threading.Lock()
    in_flight = 0
    most_in_flight = 0

    def do_GET(self) -> None:  # noqa: N802
        behaviour = self.behaviour
        if behaviour == "slow":  # a normal answer after a while, counting how many wait at once
            with Hostile.lock:
                Hostile.in_flight += 1
                Hostile.most_in_flight = max(Hostile.most_in_flight, Hostile.in_flight)
            time.sleep(0.3)
            with Hostile.lock:
                Hostile.in_flight -= 1
            behaviour = "normal"
        if behaviour == "normal":
            self._head({"Content-Length": str(len(NORMAL))})
            self.wfile.write(NORMAL)
        elif behaviour == "huge-declared":
            self._head({"Content-Length": str(HUGE)})
            _write_until_closed(self, HUGE)
        elif behaviour == "huge-undeclared":  # no length: the body ends when the connection closes
            self._head({})
            _write_until_closed(self, HUGE)
        elif behaviour == "gzip-bomb":
            self._head({"Content-Length": str(len(BOMB)), "Content-Encoding": "gzip"})
            self.wfile.write(BOMB)
        elif behaviour == "drip-body":
            self._head({})
            self._drip(b"packtrain_train_step 1\n" * 4)
        elif behaviour == "huge-headers":  # 300 MB of header lines before any body
            self.send_response(200)
            try:
                for i in range(HUGE // 8192):
                    self.send_header(f"X-Pad-{i}", "a" * 8000)
                    if i % 64 == 0:
                        self.flush_headers()
            except OSError:
                pass
        elif behaviour == "drip-headers":
            self._drip(b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 64)
        else:
            self.send_error(404)

    def _head(self, headers: dict[str, str]) -> None:
        self.send_response(200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.flush()

    def _drip(self, data: bytes) -> None:
        try:
            for byte in data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(DRIP_EVERY)
        except OSError:
            pass

    def log_message(self, *args: Any) -> None:
        pass


def _server(behaviour: str) -> http.server.ThreadingHTTPServer:
    handler = type(f"Serve_{behaviour}", (Hostile,), {"behaviour": behaviour})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def port_of() -> Iterator[Callable[[str], int]]:
    """`port_of(behaviour)`: the port of a real local server with that behaviour (one per metrics port)."""
    started: dict[str, http.server.ThreadingHTTPServer] = {}

    def get(behaviour: str) -> int:
        if behaviour not in started:
            started[behaviour] = _server(behaviour)
        return int(started[behaviour].server_address[1])

    yield get
    for server in started.values():
        server.shutdown()
        server.server_close()


def _fetch(url: str) -> tuple[str | Exception, float]:
    async def run() -> str:
        async with scrape.session() as client:
            return await scrape.fetch(client, url)

    t0 = time.monotonic()
    try:
        result: str | Exception = asyncio.run(run())
    except scrape.ScrapeError as exc:
        result = exc
    return result, time.monotonic() - t0


@pytest.mark.parametrize(
    "behaviour,why",
    [
        ("huge-declared", "over the 1048576-byte cap"),
        ("huge-undeclared", "over the 1048576-byte cap"),
        ("huge-headers", "Too many headers"),
        ("drip-body", "no complete answer within 5 s"),
        ("drip-headers", "no complete answer within 5 s"),
    ],
)
def test_a_hostile_endpoint_is_cut_off_within_the_caps(
    port_of: Callable[[str], int], behaviour: str, why: str
) -> None:
    tracemalloc.start()
    try:
        result, seconds = _fetch(f"http://127.0.0.1:{port_of(behaviour)}/metrics")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(result, scrape.ScrapeError) and why in str(result), result
    assert seconds < scrape.DEADLINE + 1.5, f"{behaviour} held the scrape {seconds:.1f} s"
    assert peak < 4 * scrape.MAX_BYTES, f"{behaviour}: {peak / 2**20:.1f} MiB allocated"


def test_a_gzip_bomb_is_not_inflated(port_of: Callable[[str], int]) -> None:
    tracemalloc.start()
    try:
        result, _ = _fetch(f"http://127.0.0.1:{port_of('gzip-bomb')}/metrics")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(result, str) and len(result) <= scrape.MAX_BYTES  # the compressed bytes, as sent
    assert peak < 4 * scrape.MAX_BYTES, f"{peak / 2**20:.1f} MiB allocated"


class Cluster:
    """SFTJobs, each Running with a master pod whose metrics port is one of the servers."""

    def __init__(self, jobs: dict[str, int]) -> None:
        self.jobs = jobs
        self.merged: dict[str, tuple[float, dict[str, Any]]] = {}

    def get(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (group, plural) == (GROUP, "sftjobs")
        port = self.jobs[name]
        return {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "data": {"path": "/data/pack"},
                "model": {"path": "/models/m"},
                "training": {"maxSteps": 100},
                "volumes": {"data": {"claimName": "d"}, "checkpoints": {"claimName": "c"}},
                "metricsPort": port,
            },
            "status": {"phase": "Running"},
        }

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        assert selector.removeprefix(f"{names.SFTJOB_LABEL}=") in self.jobs
        return [
            {
                "metadata": {"labels": {"training.kubeflow.org/replica-type": "master"}},
                "status": {"phase": "Running", "podIP": "127.0.0.1"},
            }
        ]

    def merge_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.merged[name] = (time.monotonic(), status)


def _round(cluster: Cluster, limit: int) -> list[dict[str, Any] | None]:
    async def run() -> list[dict[str, Any] | None]:
        async with scrape.session() as client:
            return await progress.progress_round(
                cluster,  # type: ignore[arg-type]
                client,
                [("ml", name) for name in sorted(cluster.jobs)],
                asyncio.Semaphore(limit),
                handlers.common.now,
            )

    return asyncio.run(run())


def test_hostile_endpoints_do_not_hold_up_or_blow_up_the_normal_one(port_of: Callable[[str], int]) -> None:
    behaviours = ["drip-body", "drip-headers", "huge-declared", "huge-undeclared", "gzip-bomb", "normal"]
    # Sorted by name the normal job comes last: scraped one after another, it would wait for all the others.
    cluster = Cluster({f"{i}-{b}": port_of(b) for i, b in enumerate(behaviours)})
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        results = _round(cluster, scrape.CONCURRENCY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    seconds = time.monotonic() - t0
    normal = f"{len(behaviours) - 1}-normal"
    assert results[:-1] == [None] * (len(behaviours) - 1)
    assert results[-1] is not None and results[-1]["step"] == 42 and results[-1]["maxSteps"] == 100
    arrived, status = cluster.merged[normal]
    assert status == {"progress": results[-1]}
    # Each endpoint cut off is recorded as such (the gzip bomb's bytes arrive whole: no progress in them).
    errors = {name: s["scrapeError"]["message"] for name, (_, s) in cluster.merged.items() if name != normal}
    assert sorted(errors) == [f"{i}-{b}" for i, b in enumerate(behaviours[:4])], errors
    assert all("could not be read: " in message for message in errors.values()), errors
    assert arrived - t0 < 2.0, f"the normal job's progress took {arrived - t0:.1f} s"
    assert seconds < scrape.DEADLINE + 2.0, f"the round took {seconds:.1f} s"
    assert peak < 8 * scrape.MAX_BYTES, f"{peak / 2**20:.1f} MiB allocated"


def test_scrapes_run_concurrently_up_to_the_bound(port_of: Callable[[str], int]) -> None:
    """Twelve jobs on a server that answers after 0.3 s: four at a time, so three waves, never more at
    once."""
    cluster = Cluster({f"job-{i:02d}": port_of("slow") for i in range(12)})
    Hostile.most_in_flight = 0
    t0 = time.monotonic()
    results = _round(cluster, 4)
    seconds = time.monotonic() - t0
    assert [r and r["step"] for r in results] == [42] * 12
    assert Hostile.most_in_flight == 4
    assert 0.9 <= seconds < 3.0, f"{seconds:.2f} s: not three waves of 0.3 s"


def test_unparsable_metrics_give_no_progress() -> None:
    from packtrain.operator import progress as status

    assert status.progress_from_metrics('packtrain_train_step{rank="0"} NaN\n', 10, "t") is None
    assert status.progress_from_metrics("\x00\x01 not prometheus {{{", 10, "t") is None


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_closed_port_is_a_scrape_error_not_a_crash() -> None:
    result, seconds = _fetch(f"http://127.0.0.1:{_unused_port()}/metrics")
    assert isinstance(result, scrape.ScrapeError) and seconds < scrape.DEADLINE


class _IPv6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


class IPv6Cluster(Cluster):
    """The same jobs, their master pods on an IPv6 (or dual-stack) cluster."""

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [
            {**pod, "status": {**pod["status"], "podIP": "::1"}} for pod in super().pods(namespace, selector)
        ]


def test_an_ipv6_pod_ip_is_scraped_in_brackets() -> None:
    assert scrape.metrics_url("fd00:10:244::5", 9400) == "http://[fd00:10:244::5]:9400/metrics"
    assert scrape.metrics_url("10.244.0.5", 9400) == "http://10.244.0.5:9400/metrics"
    handler = type("Serve_normal_v6", (Hostile,), {"behaviour": "normal"})
    server = _IPv6Server(("::1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (progress,) = _round(IPv6Cluster({"v6": int(server.server_address[1])}), 1)
    finally:
        server.shutdown()
        server.server_close()
    assert progress is not None and progress["step"] == 42

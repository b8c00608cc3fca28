"""Bounded scrapes of the trainers' `/metrics`: the endpoint runs an image a CR author picks.

A scrape reads at most `MAX_BYTES`, is over within `DEADLINE` seconds all told (connect,
headers and body: a server that drips one byte every few seconds is cut off, not waited
on), and at most `CONCURRENCY` run at once, so one hostile or stuck pod can neither
exhaust the operator's memory nor hold up the progress of every other SFTJob.
"""

from __future__ import annotations

import asyncio

import aiohttp

# The trainer's rank-0 /metrics is a few KiB; 1 MiB leaves room for many GPUs' NVML gauges.
MAX_BYTES = 1 << 20
DEADLINE = 5.0
CONCURRENCY = 16
_CHUNK = 1 << 16


def metrics_url(pod_ip: str, port: int) -> str:
    """`http://IP:PORT/metrics`, an IPv6 pod IP in brackets (RFC 3986), as on an IPv6 or dual-stack
    cluster."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/metrics"


class ScrapeError(Exception):
    """Why a scrape gave no metrics (the endpoint's fault, never the operator's)."""


def session() -> aiohttp.ClientSession:
    """A client session for scrapes: no decompression (a small gzip body can inflate without bound)."""
    return aiohttp.ClientSession(
        auto_decompress=False,
        connector=aiohttp.TCPConnector(limit=CONCURRENCY, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None),
    )


async def fetch(
    client: aiohttp.ClientSession, url: str, *, max_bytes: int = MAX_BYTES, deadline: float = DEADLINE
) -> str:
    """The body of `GET url` as text; raises `ScrapeError` saying why there is none."""
    body = bytearray()
    try:
        async with asyncio.timeout(deadline):
            async with client.get(
                url, allow_redirects=False, headers={"Accept-Encoding": "identity"}
            ) as response:
                if response.status != 200:
                    raise ScrapeError(f"HTTP {response.status}")
                if response.content_length is not None and response.content_length > max_bytes:
                    raise ScrapeError(
                        f"a {response.content_length}-byte body is over the {max_bytes}-byte cap"
                    )
                async for chunk in response.content.iter_chunked(_CHUNK):
                    body += chunk
                    if len(body) > max_bytes:
                        raise ScrapeError(f"the body is over the {max_bytes}-byte cap")
    except TimeoutError as exc:
        raise ScrapeError(f"no complete answer within {deadline:g} s") from exc
    except aiohttp.ClientError as exc:
        raise ScrapeError(str(exc) or type(exc).__name__) from exc
    return body.decode("utf-8", errors="replace")

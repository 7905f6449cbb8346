"""http(s) image URLs, fetched only where the operator allows it (`serve --allow-image-urls`).

A fetch is a request the gateway makes on a client's behalf from inside the operator's network, so
it is closed to that network by construction:

- every address a host name resolves to must be public (not loopback, private, link-local, shared,
  multicast, unspecified or reserved; IPv4 and IPv6, IPv4-mapped included), unless the operator named
  its network (`--image-url-network 10.0.0.0/8`); the connection goes to the address that was checked
  (no second lookup to rebind), with TLS still verified against the host name;
- redirects are followed by hand, a few at most, each target checked as the first;
- the bytes are capped while they stream, the whole request's fetches share one time budget, and
  fetching holds an admission slot (429 past `--max-active`) so no queue of fetches builds up;
- whatever goes wrong, the caller is told only that the URL could not be fetched: never the upstream
  status, never which check refused it (the operator's log says).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import ipaddress
import logging
import socket
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.errors import InvalidRequest

__all__ = ["FetchRefused", "address_refusal", "fetch_remote_images", "remote_image_urls"]

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_PARALLEL = 4  # one request's URLs fetched at once


class FetchRefused(Exception):
    """Why one URL is not fetched: for the operator's log, never for the caller."""


@dataclass(frozen=True, slots=True)
class FetchRules:
    """What fetching may do, from `ImageLimits`."""

    max_bytes: int  # one image
    max_total_bytes: int  # all of one request's fetched images
    max_redirects: int
    budget_seconds: float  # all of one request's fetches
    trusted: tuple[IPNetwork, ...]  # networks the operator opened (an internal image store)


def address_refusal(address: IPAddress, trusted: Sequence[IPNetwork] = ()) -> str | None:
    """Why the gateway must not connect to `address`, or None when it may."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if any(address.version == net.version and address in net for net in trusted):
        return None
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    if isinstance(address, ipaddress.IPv6Address) and (address.sixtofour or address.teredo):
        return "tunnelled"  # an IPv6 address that carries an IPv4 one
    if not address.is_global:
        return "not globally routable"  # shared (100.64/10), documentation, benchmarking ranges
    return None


def remote_image_urls(body: Any) -> list[tuple[dict[str, Any], str, str, str]]:
    """Every http(s) image URL of a request body, as (the object holding it, its key, the URL, where)."""
    found: list[tuple[dict[str, Any], str, str, str]] = []
    _walk(body, "", found)
    return found


def _walk(node: Any, where: str, found: list[tuple[dict[str, Any], str, str, str]]) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, f"{where}[{i}]", found)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    holder: dict[str, Any] | None = None
    key = ""
    if kind == "image_url":  # chat: {"image_url": "..."} or {"image_url": {"url": "..."}}
        holder, key = (node["image_url"], "url") if isinstance(node.get("image_url"), dict) else (node, "image_url")
    elif kind == "input_image":  # Responses
        holder, key = node, "image_url"
    elif kind == "url" and isinstance(node.get("url"), str):  # Messages: an image block's source
        holder, key = node, "url"
    if holder is not None and isinstance(holder.get(key), str) and holder[key].startswith(("http://", "https://")):
        found.append((holder, key, holder[key], where))
    for name, value in node.items():
        if isinstance(value, (dict, list)):
            _walk(value, f"{where}.{name}" if where else name, found)


async def fetch_remote_images(body: dict[str, Any], rules: FetchRules) -> int:
    """Fetch the http(s) image URLs of a request body and put each image inline (a base64 `data:` URL,
    or a base64 source for Messages), so that the dialect checks it as any other. Returns how many
    were fetched. A URL that cannot be fetched is a 400 naming its place in the body."""
    import httpx

    found = remote_image_urls(body)
    if not found:
        return 0
    fetched: dict[str, tuple[str, bytes]] = {}  # a URL the body repeats is fetched once
    total = 0
    gate = asyncio.Semaphore(_PARALLEL)
    # trust_env off: a proxy from the environment would connect where the check did not look
    client = httpx.AsyncClient(timeout=rules.budget_seconds, follow_redirects=False, trust_env=False, verify=_tls())
    async with client:

        async def one(url: str, where: str) -> None:
            nonlocal total
            async with gate:
                if url in fetched:
                    return
                try:
                    media, data = await _fetch(client, url, rules, rules.max_total_bytes - total)
                except FetchRefused as why:
                    log.warning("image URL %s not fetched: %s", url[:200], why)
                    raise InvalidRequest(
                        f"{where}: the image URL could not be fetched (only public http(s) addresses are "
                        f"fetched, at most {rules.max_bytes:,} bytes an image)",
                        param=where,
                        code="image_url_not_fetched",
                    ) from None
                fetched[url] = (media, data)
                total += len(data)

        try:
            async with asyncio.timeout(rules.budget_seconds):
                async with asyncio.TaskGroup() as tasks:
                    for _, _, url, where in found:
                        tasks.create_task(one(url, where))
        except TimeoutError:
            raise InvalidRequest(
                f"the request's image URLs could not be fetched within {rules.budget_seconds:g} s",
                code="image_url_not_fetched",
            ) from None
        except BaseExceptionGroup as group:  # the first refusal speaks for the request
            raise next(_leaves(group)) from None
    for holder, key, url, _ in found:
        media, data = fetched[url]
        encoded = base64.b64encode(data).decode()
        if key == "url" and holder.get("type") == "url":  # a Messages source becomes a base64 one
            holder.clear()
            holder.update({"type": "base64", "media_type": media, "data": encoded})
        else:
            holder[key] = f"data:{media};base64,{encoded}"
    return len(fetched)


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS context every fetch verifies with (certifi's CA bundle, as httpx's default), built once a
    process: building one loads the bundle, about 50 ms of CPU on the event loop, which every request
    carrying an image URL paid before its first check."""
    import httpx

    return httpx.create_ssl_context(trust_env=False)


async def _fetch(client: Any, url: str, rules: FetchRules, room: int) -> tuple[str, bytes]:
    """One image: each hop's host checked and connected to by the address checked."""
    import httpx

    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise FetchRefused(f"not a URL: {exc}") from None
    for _ in range(rules.max_redirects + 1):
        if target.scheme not in ("http", "https") or not target.host:
            raise FetchRefused(f"not an http(s) URL: {str(target)[:200]}")
        address = await _checked_address(target.host, target.port or (443 if target.scheme == "https" else 80), rules)
        pinned = target.copy_with(host=str(address))
        headers = {"Host": target.netloc.decode("ascii"), "Accept": "image/*"}
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            async with client.stream("GET", pinned, headers=headers, extensions=extensions) as response:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    try:
                        target = target.join(response.headers["location"])
                    except httpx.InvalidURL as exc:
                        raise FetchRefused(f"redirected to no URL: {exc}") from None
                    continue
                if response.status_code != 200:
                    raise FetchRefused(f"answered {response.status_code}")
                limit = min(rules.max_bytes, room)
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise FetchRefused(f"declares {declared} bytes, past {limit}")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise FetchRefused(f"more than {limit} bytes")
                media = response.headers.get("content-type", "").split(";")[0].strip() or "application/octet-stream"
                return media, bytes(data)
        except httpx.HTTPError as exc:
            raise FetchRefused(f"{type(exc).__name__}: {exc}") from None
    raise FetchRefused(f"more than {rules.max_redirects} redirects")


async def _checked_address(host: str, port: int, rules: FetchRules) -> IPAddress:
    """The address to connect to: every address the host resolves to must be allowed (a name that
    resolves to one public and one private address is refused, whichever a connection would pick)."""
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError, OverflowError) as exc:  # no such name, a label too long, port 99999
            raise FetchRefused(f"{host} does not resolve: {exc}") from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise FetchRefused(f"{host} resolves to no address")
    for address in addresses:
        if (why := address_refusal(address, rules.trusted)) is not None:
            raise FetchRefused(f"{host} resolves to {address} ({why})")
    return addresses[0]

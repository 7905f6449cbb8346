"""Images as the dialects receive them: base64 `data:` URLs (chat completions' `image_url`, Responses'
`input_image`), Anthropic's base64 `image` blocks. Each is checked here, before anything is recorded:
decodable, of a supported type, within the size and count limits, and sent to a model that has
vision. The part that fails is named in the 400. An http(s) URL is refused unless the operator
allows fetching (`ImageLimits.allow_fetch`, `serve --allow-image-urls`): then the serving layer
fetches it before the request is parsed (`server/image_urls.py`: public addresses only, bounded in
bytes, redirects and time), and the image goes on as if it had been sent inline. Off by default.

What comes out is the gateway's image part, `{"type": "image", "image": <digest>}`, and the decoded
image under its digest in the intake.

Decoding is bounded before it starts, and never held on the event loop: each image's type and size
are read from its header as it is parsed (Pillow's `Image.open` reads no pixels), its pixels checked
against `max_pixels` and the pixels still to decode in the request against `max_total_pixels`; only
once every image of the request has passed are they decoded, one at a time (`ImageIntake.finish`,
which `LazyIntake.images` runs at the end of parsing). The serving layer parses a request that
carries base64 data on a worker thread (`serving.parsed_off_loop`), so the decoding runs there: 65
distinct 4096 x 4096 PNGs of 50 KB each once held the loop 6-16 s a request.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokentape.core.bounded import BoundedCache
from tokentape.core.images import IMAGE_PART, DecodedImage
from tokentape.errors import InvalidRequest
from tokentape.server.image_urls import FetchRules

__all__ = [
    "IMAGE_TYPES",
    "ImageIntake",
    "ImageLimits",
    "LazyIntake",
    "text_only_intake",
]

# media type -> the format name Pillow gives it
IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}
_FORMAT_TYPES = {fmt: media for media, fmt in IMAGE_TYPES.items()}


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request may send. `max_pixels` bounds a decoded image (a small file can decode to an
    enormous bitmap); `allow_fetch` lets http(s) image URLs be fetched by the gateway, from public
    addresses and the operator's `fetch_networks` only (`server/image_urls.py`)."""

    max_bytes: int = 10 * 1024 * 1024
    max_images: int = 64  # distinct images: a screenshot the history repeats counts once
    max_pixels: int = 4096 * 4096
    # the pixels one request may have decoded (images checked lately are not decoded again): sixteen
    # 4096 x 4096 images, 129 screenshots of 1920 x 1080; about a second of decoding on one core
    max_total_pixels: int = 16 * 4096 * 4096
    allow_fetch: bool = False
    fetch_networks: tuple[str, ...] = ()  # CIDRs fetched although not public (an internal image store)
    max_fetch_bytes: int = 32 * 1024 * 1024  # all of one request's fetched images: twice the body limit
    max_redirects: int = 3
    fetch_seconds: float = 20.0  # all of one request's fetches together

    def fetch_rules(self) -> FetchRules:
        return FetchRules(
            max_bytes=self.max_bytes,
            max_total_bytes=self.max_fetch_bytes,
            max_redirects=self.max_redirects,
            budget_seconds=self.fetch_seconds,
            trusted=tuple(ipaddress.ip_network(net, strict=False) for net in self.fetch_networks),
        )


class ImageIntake:
    """The images of one request, checked as they are parsed."""

    def __init__(
        self,
        limits: ImageLimits,
        *,
        vision: bool,
        model: str = "this model",
        refusal: Callable[[int, int], str | None] | None = None,
    ) -> None:
        self.limits = limits
        self.vision = vision
        self.model = model
        self.refusal = refusal  # (width, height) -> why the model's processor refuses that size, or None
        self.images: dict[str, DecodedImage] = {}
        self._pending: list[tuple[str, bytes, str]] = []  # (digest, bytes, where) checked from their header only
        self._pending_pixels = 0

    def url(self, url: Any, where: str) -> dict[str, Any]:
        """An `image_url` (a `data:` URL with base64 content)."""
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"{where}: the image URL must be a non-empty string", param=where)
        if url.startswith(("http://", "https://")):
            self._check_vision(where)
            raise InvalidRequest(
                f"{where}: image URLs are not fetched by this gateway; send the image inline as a base64 "
                "data: URL (data:image/png;base64,...)",
                param=where,
                code="image_url_not_allowed",
            )
        if not url.startswith("data:"):
            raise InvalidRequest(f"{where}: the image URL must be a data: URL", param=where)
        head, comma, payload = url[5:].partition(",")
        if not comma or not head.endswith(";base64"):
            raise InvalidRequest(f"{where}: the data: URL must be base64 (data:image/png;base64,...)", param=where)
        return self.base64(head[: -len(";base64")], payload, where)

    def base64(self, media_type: Any, data: Any, where: str) -> dict[str, Any]:
        """Base64 image bytes of a declared media type: any image type or bare bytes may be declared
        (`image/jpg`, `application/octet-stream` from a server that does not say); the bytes decide."""
        self._check_vision(where)
        if not _may_be_an_image(media_type):
            raise InvalidRequest(
                f"{where}: images of type {str(media_type)[:60]!r} are not supported (use {', '.join(IMAGE_TYPES)})",
                param=where,
                code="unsupported_image_type",
            )
        if not isinstance(data, str):
            raise InvalidRequest(f"{where}: the image data must be a base64 string", param=where)
        if len(data) * 3 // 4 > self.limits.max_bytes:
            raise self._too_large(where)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(f"{where}: the image data is not valid base64", param=where) from exc
        return self.raw(raw, where)

    def raw(self, raw: bytes, where: str) -> dict[str, Any]:
        """Image bytes, whatever their declared type: what they decode to decides."""
        self._check_vision(where)
        if len(raw) > self.limits.max_bytes:
            raise self._too_large(where)
        digest = hashlib.sha256(raw).hexdigest()
        if digest not in self.images:
            if len(self.images) >= self.limits.max_images:
                raise InvalidRequest(
                    f"{where}: a request may hold at most {self.limits.max_images} distinct images",
                    param=where,
                    code="too_many_images",
                )
            facts = _checked.get(digest)
            known = None if facts is None else DecodedImage(digest, raw, *facts)
            fits = known is not None and known.width * known.height <= self.limits.max_pixels
            image = known if known is not None and fits else self._header(raw, digest, where)
            reason = self.refusal(image.width, image.height) if self.refusal is not None else None
            if reason is not None:
                raise InvalidRequest(
                    f"{where}: the model's image processor cannot take this "
                    f"{image.width}x{image.height} image: {reason}",
                    param=where,
                    code="invalid_image",
                )
            self.images[digest] = image
        return {"type": IMAGE_PART, IMAGE_PART: digest}

    def _header(self, raw: bytes, digest: str, where: str) -> DecodedImage:
        """What an image's header says (type, size), checked against the limits; its pixels are decoded
        by `finish`, once every image of the request has been checked."""
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(raw)) as image:
                    fmt, (width, height) = image.format, image.size
        except Exception as exc:
            raise self._undecodable(where, exc) from exc
        if width * height > self.limits.max_pixels:
            raise InvalidRequest(
                f"{where}: the image is {width}x{height} pixels; at most {self.limits.max_pixels:,} pixels "
                "are accepted",
                param=where,
                code="image_too_large",
            )
        media_type = _FORMAT_TYPES.get(fmt or "")
        if media_type is None:
            raise InvalidRequest(
                f"{where}: images in {fmt} format are not supported (use {', '.join(IMAGE_TYPES)})",
                param=where,
                code="unsupported_image_type",
            )
        self._pending_pixels += width * height
        if self._pending_pixels > self.limits.max_total_pixels:
            raise InvalidRequest(
                f"{where}: the request's new images hold {self._pending_pixels:,} pixels so far; at most "
                f"{self.limits.max_total_pixels:,} are decoded for one request (send fewer or smaller images)",
                param=where,
                code="image_too_large",
            )
        self._pending.append((digest, raw, where))
        return DecodedImage(digest, raw, media_type, width, height)

    def finish(self) -> None:
        """Decode every image checked from its header only (a truncated or corrupt file fails here, not
        in the processor), one at a time; each one decoded is remembered (`_checked`)."""
        from PIL import Image

        pending, self._pending = self._pending, []
        for digest, raw, where in pending:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    with Image.open(io.BytesIO(raw)) as image:
                        image.load()
            except Exception as exc:
                raise self._undecodable(where, exc) from exc
            decoded = self.images[digest]
            _checked.put(digest, (decoded.media_type, decoded.width, decoded.height))

    @staticmethod
    def _undecodable(where: str, exc: Exception) -> InvalidRequest:
        return InvalidRequest(
            f"{where}: the image cannot be decoded ({type(exc).__name__})", param=where, code="invalid_image"
        )

    def _too_large(self, where: str) -> InvalidRequest:
        return InvalidRequest(
            f"{where}: an image may be at most {self.limits.max_bytes:,} bytes",
            param=where,
            code="image_too_large",
        )

    def _check_vision(self, where: str) -> None:
        if not self.vision:
            raise InvalidRequest(
                f"{where}: {self.model} has no vision; images need a vision-language model served with its "
                "processor (a Qwen2-VL model directory behind a vLLM engine)",
                param=where,
                code="images_not_supported",
            )


def text_only_intake() -> ImageIntake:
    """The intake of a caller that takes no images (a text-only model): any image part is refused."""
    return ImageIntake(ImageLimits(), vision=False)


class LazyIntake:
    """One request's intake, made on its first image: text-only requests never pay for one."""

    def __init__(self, make: Callable[[], ImageIntake]) -> None:
        self._make = make
        self._intake: ImageIntake | None = None

    def __call__(self) -> ImageIntake:
        if self._intake is None:
            self._intake = self._make()
        return self._intake

    @property
    def images(self) -> dict[str, DecodedImage] | None:
        """The request's images by digest, each decoded (`ImageIntake.finish`); None when it brought none."""
        if self._intake is None:
            return None
        self._intake.finish()
        return self._intake.images


# Images decoded lately, by digest: agents send their whole history each turn, and a screenshot checked
# once need not be decoded again (its bytes are the ones hashed, so the digest vouches). Only the facts
# are kept (type, width, height), never the bytes.
_checked: BoundedCache[str, tuple[str, int, int]] = BoundedCache(1 << 20, lambda _: 128, max_items=4096)


def _may_be_an_image(media_type: Any) -> bool:
    """Whether a declared media type leaves it to the bytes: an image type, or bytes of no stated kind."""
    if not isinstance(media_type, str):
        return False
    declared = media_type.strip().lower()
    return declared.startswith("image/") or declared in ("", "application/octet-stream", "binary/octet-stream")


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def joined(parts: list[Mapping[str, Any]]) -> str | list[Mapping[str, Any]]:
    """Content as the chat template gets it: one string when it is all text, else the parts (adjacent
    texts joined)."""
    if all(p.get("type") == "text" for p in parts):
        return "".join(str(p.get("text", "")) for p in parts)
    out: list[Mapping[str, Any]] = []
    for part in parts:
        if part.get("type") == "text" and out and out[-1].get("type") == "text":
            out[-1] = text_part(str(out[-1].get("text", "")) + str(part.get("text", "")))
        else:
            out.append(part)
    return out

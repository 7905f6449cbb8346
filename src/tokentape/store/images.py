"""Image bytes by digest: the store holds each distinct image once (its `images` table, shared by
every session and turn that shows it), sessions' trees hold only each image's facts, and the bytes are
read back on demand, for an engine that is sent them (vLLM's render route, verl, SkyRL), the image
processor, an export or the viewer, through one cache bounded in bytes.

Where the bytes are, from the moment a request brings an image:
  - in the request itself (`ChatCall.images`) while it runs: the engine and the processor read
    them from there;
  - in the turn's write, queued with it, until it commits: `keep` pins them here (`pending`) until
    the write lands, so that another request of the session that names the image without sending it
    (a Responses API continuation) finds it before the store does;
  - in the store once committed, for good: nothing ever deletes an image's row, so dropping the
    cached copy loses nothing, and the next read brings back the same bytes.

A ":memory:" store (`SqliteStore(":memory:")`, what a gateway without a store path uses) keeps its
images table in the process's memory: each distinct image once, as long as the process, as its turns
are. That is the store there is in that mode: its sessions' trees and this cache are bounded as with a
store on disk, the table itself is not (nothing in it may be dropped while a session can reload).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokentape.core.bounded import BoundedCache
from tokentape.core.images import DecodedImage
from tokentape.core.session import SessionTree
from tokentape.errors import StoreFailure
from tokentape.store.base import TrajectoryStore

__all__ = ["IMAGE_CACHE_BYTES", "IMAGE_ENTRY_BYTES", "ImageLibrary"]

IMAGE_CACHE_BYTES = 256 * 1024**2  # ~1,500 screenshots of 175 KB: every image a few hundred agents show now
IMAGE_ENTRY_BYTES = 256  # what an entry costs beside its bytes: the object, its digest, the cache's slot


def _size(image: DecodedImage) -> int:
    return len(image.data) + IMAGE_ENTRY_BYTES


class ImageLibrary:
    """Reads image bytes by digest: pinned (written, not yet committed), cached, else from the store."""

    def __init__(self, store: TrajectoryStore, max_bytes: int = IMAGE_CACHE_BYTES) -> None:
        self.store = store
        self.cache: BoundedCache[str, DecodedImage] = BoundedCache(max_bytes, _size)
        self._pending: dict[str, tuple[DecodedImage, int]] = {}  # digest -> (image, writes holding it)
        self.pending_bytes = 0
        self.store_reads = 0  # digests read back from the store (a cache miss each)

    @property
    def held_bytes(self) -> int:
        """The bytes this holds: the cache's and the pinned images' (an image both cached and pinned
        is counted twice, so this is an upper bound)."""
        return self.cache.held_bytes + self.pending_bytes

    def keep(self, images: Iterable[DecodedImage], written: asyncio.Future[Any] | None = None) -> None:
        """Images a turn's write stores: cached, and pinned until `written` settles (committed or
        not: a failed write's turn is never acknowledged, and a later request sends the image again)."""
        kept = list({image.digest: image for image in images}.values())
        for image in kept:
            self.cache.put(image.digest, image)
        if written is None or written.done():
            return
        for image in kept:
            held, count = self._pending.get(image.digest, (image, 0))
            if count == 0:
                self.pending_bytes += _size(held)
            self._pending[image.digest] = (held, count + 1)
        written.add_done_callback(lambda _: self._release(kept))

    def _release(self, images: list[DecodedImage]) -> None:
        for image in images:
            held, count = self._pending[image.digest]
            if count > 1:
                self._pending[image.digest] = (held, count - 1)
            else:
                del self._pending[image.digest]
                self.pending_bytes -= _size(held)

    def known(self, digest: str) -> DecodedImage | None:
        """The image if it is pinned or cached now; never reads the store."""
        pinned = self._pending.get(digest)
        return pinned[0] if pinned is not None else self.cache.get(digest)

    async def of_trees(self, trees: Iterable[SessionTree]) -> Mapping[str, DecodedImage]:
        """The bytes of every image `trees` show, for an export (not kept in the cache)."""
        return await self.read_all((digest for tree in trees for digest in tree.images), keep=False)

    async def read(self, digests: Sequence[str], *, keep: bool = True) -> dict[str, DecodedImage]:
        """The images of `digests`, by digest: from memory where they are, the rest in one store read
        (cached unless `keep` is False: an export's pages read once). A digest the store does not
        hold is absent from the answer."""
        found: dict[str, DecodedImage] = {}
        missing: list[str] = []
        for digest in dict.fromkeys(digests):
            image = self.known(digest)
            if image is None:
                missing.append(digest)
            else:
                found[digest] = image
        if missing:
            stored = await self.store.read_images(missing)
            self.store_reads += len(stored)
            for digest, image in stored.items():
                if keep:
                    self.cache.put(digest, image)
                found[digest] = image
        return found

    async def read_all(self, digests: Iterable[str], *, keep: bool = True) -> Mapping[str, DecodedImage]:
        """`read`, for digests a session's turns show: one that is nowhere is a damaged store."""
        wanted = list(dict.fromkeys(digests))
        found = await self.read(wanted, keep=keep) if wanted else {}
        missing = [digest for digest in wanted if digest not in found]
        if missing:
            raise StoreFailure(f"image {missing[0]} that a recorded turn shows is not in the store")
        return found

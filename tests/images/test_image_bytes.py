"""Image bytes live in the store, once per distinct image, and are read back by digest through one
cache bounded in bytes: sessions' trees hold each image's facts only, two sessions showing the same
screenshot store its bytes once, and what leaves the cache comes back from the store byte for byte
(for an export, and for the engine when a continued conversation names an image it does not send).
The engine is the scripted fake vLLM of the test suite."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from tests.images.conftest import App, Oracle, data_url, png
from tokentape.core.images import DecodedImage, ImageFacts
from tokentape.core.session import BYTES_PER_IMAGE, BYTES_PER_TOKEN
from tokentape.store.images import IMAGE_ENTRY_BYTES, ImageLibrary
from tokentape.store.sqlite import SqliteStore

RED, BLUE = (200, 30, 30), (30, 30, 200)


def _ask(image: bytes, text: str = "What is on screen?") -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    return {"role": "user", "content": [{"type": "text", "text": text}, part]}


async def _post(app: App, session: str, messages: list[dict[str, Any]], oracle: Oracle, reply: str) -> None:
    app.queue(oracle.answer(reply))
    body = {"model": "m", "messages": messages, "max_tokens": 20}
    response = await app.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": session})
    assert response.status_code == 200, response.text


async def test_two_sessions_showing_one_image_hold_its_bytes_once_and_their_trees_none(
    app: App, oracle: Oracle
) -> None:
    red = png(RED, (96, 64))
    for session in ("left", "right"):
        await _post(app, session, [_ask(red)], oracle, "Red.")
    await app.gateway.sessions.store.flush()
    assert await app.gateway.sessions.store.image_stats() == {"images": 1, "bytes": len(red)}
    digest = hashlib.sha256(red).hexdigest()
    for session in ("left", "right"):
        held = app.gateway.sessions.in_memory(session)
        assert held is not None
        tree = held.tree
        assert tree.images == {digest: ImageFacts(digest, "image/png", 96, 64, len(red))}
        assert not any(isinstance(value, DecodedImage) for value in vars(tree).values())
        # the prompt's JSON, as the engine was sent it, is kept for the session's next prompt
        assert tree.held_bytes == BYTES_PER_TOKEN * tree.token_count + BYTES_PER_IMAGE + tree.prompt_text.held_bytes
    # the one copy in memory is the library's cache, counted once against the budget
    library = app.gateway.sessions.images
    assert len(library.cache) == 1 and library.cache.held_bytes == len(red) + IMAGE_ENTRY_BYTES


async def test_an_image_out_of_the_cache_comes_back_from_the_store_byte_for_byte(app: App, oracle: Oracle) -> None:
    red, blue = png(RED), png(BLUE, (80, 56))
    messages = [_ask(red)]
    await _post(app, "evicted", messages, oracle, "Red.")
    messages += [{"role": "assistant", "content": "Red."}, _ask(blue, "And now?")]
    await _post(app, "evicted", messages, oracle, "Blue.")
    library = app.gateway.sessions.images
    await app.gateway.sessions.store.flush()
    library.cache.resize(0)  # everything leaves the cache
    assert len(library.cache) == 0 and library.known(hashlib.sha256(red).hexdigest()) is None
    reads = library.store_reads
    (branch,) = (await app.export("evicted"))["branches"]
    assert branch["images"] == [data_url(red), data_url(blue)]
    assert library.store_reads == reads + 2  # both read back from the store, one read
    again = await library.read([hashlib.sha256(blue).hexdigest()])
    (image,) = again.values()
    assert image.data == blue and image.digest == hashlib.sha256(image.data).hexdigest()
    assert (image.media_type, image.width, image.height) == ("image/png", 80, 56)


async def test_a_continued_conversation_sends_the_engine_an_image_read_back_from_the_store(
    app: App, oracle: Oracle
) -> None:
    red = png(RED, (70, 70))
    app.queue(oracle.answer("Red."))
    first = await app.openai.responses.create(
        model="m",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Color?"},
                    {"type": "input_image", "image_url": data_url(red)},
                ],
            }
        ],
        max_output_tokens=20,
        extra_headers={"X-Session-ID": "continued"},
    )
    library = app.gateway.sessions.images
    await app.gateway.sessions.store.flush()
    library.cache.resize(0)
    reads = library.store_reads
    app.queue(oracle.answer("Sure."))
    second = await app.openai.responses.create(
        model="m",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Sure?"}]}],
        previous_response_id=first.id,
        max_output_tokens=20,
        extra_headers={"X-Session-ID": "continued"},
    )
    assert second.output_text == "Sure."
    assert library.store_reads == reads + 1  # the engine's copy of the image came from the store
    hf = [
        {"role": "user", "content": [{"type": "text", "text": "Color?"}, {"type": "image"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?"},
    ]
    assert app.engine.state.requests[-1]["token_ids"] == oracle.ids(hf, [red])


async def test_an_image_whose_write_has_not_landed_is_read_from_the_write_not_the_store() -> None:
    store = SqliteStore(":memory:")
    try:
        library = ImageLibrary(store, max_bytes=0)  # a cache that keeps nothing
        data = png(RED)
        image = DecodedImage(hashlib.sha256(data).hexdigest(), data, "image/png", 64, 48)
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        library.keep([image], written)
        assert library.pending_bytes == len(data) + IMAGE_ENTRY_BYTES == library.held_bytes
        assert await library.read([image.digest]) == {image.digest: image}
        assert library.store_reads == 0
        written.set_result(None)
        await asyncio.sleep(0)  # the done callback
        assert library.pending_bytes == 0 and library.held_bytes == 0
        assert await library.read([image.digest]) == {}  # never written: the store does not hold it
    finally:
        store.close()

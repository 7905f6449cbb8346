"""A Parquet export holds every field its JSON export holds, whatever rows come first.

A group of more than 1,024 sessions whose first sessions have nothing optional (no sampling settings
recorded, no reward, no version, no image) and whose last ones have everything a row can hold: a
logit bias and every penalty, a rewrite (kept on the tape) and a fork (at a token), a trace id, a
policy version with a KV version span, a constrained turn, a truncated turn, turn rewards, nested
metadata and an image. Written to a real store and exported in every format, from the store, as
JSON and as Parquet; the Parquet file is read back with pyarrow alone and compared with the JSON
(parsed with the standard library) field by field. A failure after the first byte ends the body
with an error, never a short body that looks whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.served import build
from tokentape.core.formats import FORMATS, Format
from tokentape.core.images import DecodedImage, ImageRun
from tokentape.core.messages import EMPTY_CHAIN
from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.staleness import LagWindow
from tokentape.core.tape import Origin, Rewrite
from tokentape.core.versions import PolicySpan
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.store import export as store_export
from tokentape.store.export import dataset_pages, encode_dataset, started
from tokentape.store.images import ImageLibrary
from tokentape.store.scan import SessionFilter, StoredSession
from tokentape.store.sqlite import SqliteStore

SESSIONS = 1100  # more than the 1,024 rows a writer once learnt its column types from
LATE = 3  # the last sessions: every optional field
# a 1x1 PNG
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c63000100000500010d0a2db40000000049454e44ae426082"
)
IMAGE = DecodedImage(hashlib.sha256(PNG).hexdigest(), PNG, "image/png", 1, 1)
# fields only some rows hold, as the export reference lists them: null in Parquet where a row lacks them
OPTIONAL = {"images", "image_grid_thw", "image_runs", "masked_by_lag"}
LATE_SAMPLING = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "logit_bias": {"17": -100.0, "5": 2.5},
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.1,
}


def _attach(tree: SessionTree, parent: Any, keep: int, context: tuple[int, ...], **fields: Any) -> Any:
    rewrite, images = fields.pop("rewrite", None), fields.pop("images", ())
    turn = NewTurn(
        parent=parent, keep=keep, context=context, context_origin=Origin.PROMPT, rewrite=rewrite, images=images
    )
    sampled = fields.pop("sampled", [7, 8, 9])
    return tree.attach(
        turn,
        sampled=sampled,
        logprobs=[-0.5 - 0.125 * i for i in range(len(sampled))],
        finish_reason=fields.pop("finish_reason", "stop"),
        prompt_chain=EMPTY_CHAIN,
        prompt_length=1,
        reply={"role": "assistant", "content": "ok"},
        **fields,
    )


def _plain(index: int) -> SessionTree:
    tree = SessionTree(f"s{index:05d}", created_at=1000.0 + index)
    tree.outcome.group_id = "g"
    first = _attach(tree, None, 0, (1, 2, 3))
    _attach(tree, first, first.end, (4, 5))
    return tree


def _everything(index: int) -> SessionTree:
    """A session with every optional field a row can hold."""
    tree = SessionTree(f"s{index:05d}", created_at=1000.0 + index)
    tree.outcome.group_id = "g"
    tree.outcome.metadata = {"task": {"id": index, "tags": ["late", None]}, "side": 1.5}
    tree.images[IMAGE.digest] = IMAGE.facts
    image = (ImageRun(IMAGE.digest, 1, 2, (1, 2, 2)),)
    first = _attach(
        tree,
        None,
        0,
        (1, 90, 91, 3),
        images=image,
        sampling=LATE_SAMPLING,
        policy_version="3",
        policy_spans=(PolicySpan(3, 0, 2, kv_version=2), PolicySpan(4, 2, 3)),
        logprob_mode="temperature_scaled_untruncated",
        trace_id="trace-a",
        constrained=True,
    )
    edited = Rewrite("assistant_edited", "tape", 1, None, "the agent edited the recorded reply")
    second = _attach(
        tree, first, first.end, (4, 5), rewrite=edited, finish_reason="length", sampling={"temperature": 1.0}
    )
    forked = Rewrite("template", "fork", 2, first.end - 1, "the template dropped a reasoning block")
    _attach(tree, first, first.end - 1, (6,), rewrite=forked, sampled=[11], policy_version="4")
    tree.outcome.set_rewards(
        reward=0.25,
        branch_rewards={second.id: 1.0},
        turn_rewards={first.id: 0.5},
        turn_ids={n.id for n in tree.nodes},
        branch_ids={n.id for n in tree.leaves},
    )
    return tree


async def _write(path: Path) -> None:
    store = SqliteStore(path)
    for index in range(SESSIONS):
        tree = _everything(index) if index >= SESSIONS - LATE else _plain(index)
        for node in tree.nodes:
            images = {IMAGE.digest: IMAGE} if node.images else None
            assert await store.save_turn(tree, node, images=images)
    await store.aclose()


async def _export(store: SqliteStore, fmt: Format, output: str, lag: LagWindow | None = None) -> bytes:
    skipped: list[StoredSession] = []
    library = ImageLibrary(store)
    pages = dataset_pages(
        lambda where: store.scan(where), SessionFilter(), fmt, skipped, lag=lag, images=library.of_trees
    )
    chunks = encode_dataset(pages, fmt, output, skipped)  # type: ignore[arg-type]
    data = b"".join([chunk async for chunk in chunks])
    assert not skipped
    return data


def _same(json_rows: list[dict[str, Any]], parquet: bytes) -> None:
    """Every JSON row's every field equals the Parquet row's; a Parquet field the JSON row lacks is
    null and optional. The Parquet side is read with pyarrow alone."""
    table = pq.read_table(io.BytesIO(parquet))
    json_columns = table.schema.metadata[b"tokentape.json_columns"].decode().split(",")
    parquet_rows = table.to_pylist()
    assert len(parquet_rows) == len(json_rows)
    for number, (expected, got) in enumerate(zip(json_rows, parquet_rows, strict=True)):
        for name in sorted(set(expected) | set(got)):
            where = f"row {number} field {name}"
            assert name in got, f"{where}: not in the Parquet file"
            if name not in expected:
                assert name in OPTIONAL and got[name] is None, f"{where}: in the Parquet file only"
                continue
            value = json.loads(got[name]) if name in json_columns and got[name] is not None else got[name]
            assert value == expected[name], where


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("late") / "store.sqlite3"
    asyncio.run(_write(path))
    return path


@pytest.fixture
def store(written: Path) -> Iterator[SqliteStore]:
    store = SqliteStore(written)
    yield store
    store.close()


@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_parquet_export_holds_what_the_json_export_holds(store: SqliteStore, fmt: Format) -> None:
    rows = json.loads(await _export(store, fmt, "json"))["data"]
    if fmt in ("tokentape", "openrlhf", "verifiers"):
        assert len(rows) > 1024
    late = [row for row in rows if row.get("session_id", "") >= f"s{SESSIONS - LATE:05d}"]
    if fmt == "tokentape":  # the late fields are there in the JSON, on late rows only
        assert {"logit_bias", "presence_penalty"} <= set(late[0]["sampling"][0])
        assert [r["kind"] for r in late[0]["rewrites"]] == ["assistant_edited"]
        assert late[0]["images"] and late[0]["policy_spans"][0][0]["kv_version"] == 2
        assert not any(row.get("rewrites") or row.get("images") for row in rows[:1024])
    _same(rows, await _export(store, fmt, "parquet"))


@pytest.mark.parametrize("fmt", ["tokentape", "verifiers"])
async def test_a_masking_export_holds_masked_by_lag_in_parquet_too(store: SqliteStore, fmt: Format) -> None:
    lag = LagWindow(4, 0, "mask")  # tokens older than version 4 out of the loss
    rows = json.loads(await _export(store, fmt, "json", lag))["data"]
    assert any(row["masked_by_lag"] for row in rows)
    _same(rows, await _export(store, fmt, "parquet", lag))


async def test_columns_are_typed_from_the_format_not_from_the_first_rows(store: SqliteStore) -> None:
    schema = pq.read_schema(io.BytesIO(await _export(store, "tokentape", "parquet")))
    assert schema.field("sampling").type == pa.string()  # JSON text: no key can be lost
    assert schema.field("rewrites").type == pa.list_(
        pa.struct(
            [
                ("kind", pa.string()),
                ("policy", pa.string()),
                ("at_message", pa.int64()),
                ("at_token", pa.int64()),
                ("detail", pa.string()),
            ]
        )
    )
    assert schema.field("tokens").type == pa.list_(pa.int64())
    assert schema.field("logprobs").type == pa.list_(pa.float64())
    assert schema.field("reward").type == pa.float64()


async def test_a_row_that_cannot_be_written_fails_before_the_first_byte_or_ends_with_an_error(
    tmp_path: Path, renderer: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP: a failure on the first page is an error response; a failure on a later page ends
    each body with an error trailer (JSON lines: a last `error` line; JSON: `error` in place of
    `skipped`; Parquet: a file no reader takes, whose last line is the error)."""
    import httpx

    store = SqliteStore(tmp_path / "store.sqlite3")
    for index in range(70):  # two pages of sessions
        tree = _plain(index)
        for node in tree.nodes:
            assert await store.save_turn(tree, node)
    store.close()
    engine = ScriptedEngine([5], end_of_turn=2)
    built = build(engine, renderer, store=SqliteStore(tmp_path / "store.sqlite3"))
    app, registry = built.app, built.gateway.sessions
    real_rows = store_export.format_rows
    calls = {"n": 0, "fail_at": 1}

    def failing_rows(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("a row the export cannot write")
        return real_rows(*args, **kwargs)

    monkeypatch.setattr(store_export, "format_rows", failing_rows)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 answered, not raised here
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for output in ("json", "jsonl", "parquet"):
            calls.update(n=0, fail_at=1)
            first = await http.get("/export", params={"output": output})
            assert first.status_code == 500, (output, first.text)
            assert first.json()["error"]["type"] == "server_error"

            calls.update(n=0, fail_at=2)
            later = await http.get("/export", params={"output": output})
            assert later.status_code == 200
            body = later.content
            if output == "jsonl":
                *good, last = body.splitlines()
                assert len(good) == 64 and all("error" not in json.loads(line) for line in good)
                assert json.loads(last)["error"]["code"] == "export_failed"
            elif output == "json":
                document = json.loads(body)
                assert len(document["data"]) == 64 and "skipped" not in document
                assert "a row the export cannot write" in document["error"]["message"]
            else:
                with pytest.raises(pa.ArrowInvalid):
                    pq.read_table(io.BytesIO(body))
                assert json.loads(body.rsplit(b"\n", 2)[-2])["error"]["code"] == "export_failed"
    await registry.aclose()


async def test_started_raises_what_fails_before_the_first_chunk() -> None:
    async def failing() -> AsyncIterator[bytes]:
        raise RuntimeError("before anything")
        yield b""  # pragma: no cover

    with pytest.raises(RuntimeError, match="before anything"):
        await started(failing())

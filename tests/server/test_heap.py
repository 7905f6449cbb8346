"""A process that exists to serve the gateway settles its garbage collector once the gateway has
started: what it loaded is frozen and collections come less often. A gateway built into another
program leaves that program's collector as it was."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.testclient import TestClient
from typer.testing import CliRunner

from tokentape.cli import app as cli
from tokentape.served import Served


@pytest.fixture
def restored_collector() -> Iterator[tuple[int, int, int]]:
    """The collector's thresholds as they were; put back (and nothing left frozen) afterwards."""
    threshold = gc.get_threshold()
    yield threshold
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_serve_freezes_what_it_loaded_once_the_gateway_has_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, restored_collector: tuple[int, int, int]
) -> None:
    seen: dict[str, Any] = {}

    def run(app: Any, **_: Any) -> None:
        seen["before start"] = gc.get_freeze_count()
        with TestClient(app) as client:  # runs the app's start-up: the gateway starts, then serves
            seen["frozen"] = gc.get_freeze_count()
            seen["threshold"] = gc.get_threshold()
            seen["health"] = client.get("/health").status_code

    monkeypatch.setattr(uvicorn, "run", run)
    gc.collect()  # what earlier tests left unreachable is not alive: settling collects it before freezing
    alive = len(gc.get_objects())
    result = CliRunner().invoke(cli, ["serve", "--store", str(tmp_path / "t.sqlite3"), "--log-level", "warning"])
    assert result.exit_code == 0, result.output
    assert seen["health"] == 200
    assert seen["before start"] == 0  # settled after the gateway started: what it loads then is frozen too
    assert seen["frozen"] >= 0.9 * alive  # everything this process held before `serve` ran, and more
    young, middle, old = seen["threshold"]
    assert young >= 10 * restored_collector[0] and middle >= restored_collector[1] and old >= restored_collector[2]


def test_a_gateway_inside_another_program_leaves_its_collector_alone(
    built: Served, restored_collector: tuple[int, int, int]
) -> None:
    with TestClient(built.app) as client:
        assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == restored_collector


_LARGE_BLOCKS = """
import ctypes, sys
from tokentape.server.heap import settle_for_serving

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    sys.exit(print("no mallinfo2"))
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "serving":
    settle_for_serving()
freed = bytearray(8 << 20)
del freed  # glibc now carves blocks of up to 8 MB from the heap, unless the size is fixed
mapped = libc.mallinfo2().hblkhd
block = bytearray(4 << 20)
print(libc.mallinfo2().hblkhd - mapped >= 4 << 20)
"""


@pytest.mark.parametrize(("process", "maps"), [("serving", "True"), ("library", "False")])
def test_a_serving_process_maps_every_large_block_and_gives_it_back(process: str, maps: str) -> None:
    """A block of 1 MB or more gets a mapping of its own, which goes back to the system when it is freed,
    even after a larger one was freed (glibc's default then carves such blocks from the heap, where freed
    memory mostly stays: the library case, which shows this libc behaves so)."""
    out = subprocess.run([sys.executable, "-c", _LARGE_BLOCKS, process], capture_output=True, text=True, check=True)
    if out.stdout.strip() == "no mallinfo2":
        pytest.skip("the C library has no mallinfo2 (not glibc 2.33 or later)")
    assert out.stdout.strip() == maps

"""One direction between the gateway and its weight updater: `gateway/service.py` imports
`gateway/updates.py`, which imports nothing of the service (not even for type checking); what the
updater touches comes in as arguments (the gate, the engines, the probe's prompt)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import tokentape.gateway.updates as updates
from tokentape.engines.weights import WeightSource
from tokentape.errors import Conflict
from tokentape.gateway.updates import WeightUpdate, WeightUpdater
from tokentape.gateway.versions import VersionGate

SERVICE = "tokentape.gateway.service"


def _imported(module: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_updater_does_not_import_the_gateway_service() -> None:
    source = Path(updates.__file__)
    assert SERVICE not in _imported(source)
    assert "tokentape.gateway.updates" in _imported(source.with_name("service.py"))


def test_the_updater_runs_on_what_it_is_given() -> None:
    """Built from a gate, an engine list and a prompt alone (no gateway): it refuses a version that is
    not new, naming the gate's version."""
    gate = VersionGate()
    gate.version = 3
    updater = WeightUpdater(gate, list, [1])
    with pytest.raises(Conflict, match="at version 3"):
        asyncio.run(updater.update(WeightUpdate(2, WeightSource("lora", "/x"))))

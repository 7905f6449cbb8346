"""`tokentape serve --ray` hands --max-staleness, --admit-per-version and --admission-wait to the
cluster's gateways."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from tokentape.cli import app as cli
from tokentape.core.staleness import Staleness


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--max-staleness", "2", "--admit-per-version", "8"], Staleness(2, 8)),
        (["--admit-per-version", "4", "--admission-wait", "2.5"], Staleness(None, 4, 2.5)),
        (["--max-staleness", "0"], Staleness(0, None)),
        ([], Staleness()),
    ],
)
def test_serve_ray_passes_staleness_on(
    monkeypatch: pytest.MonkeyPatch, options: list[str], expected: Staleness
) -> None:
    import tokentape.ray.cluster as cluster

    seen: list[Any] = []
    monkeypatch.setattr(cluster, "serve_cluster", seen.append)
    result = CliRunner().invoke(cli, ["serve", "--ray", "local", *options])
    assert result.exit_code == 0, result.output
    (spec,) = seen
    assert spec.staleness == expected
    assert spec.ray is not None and spec.ray.address == "local"

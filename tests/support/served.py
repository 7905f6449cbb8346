"""A test's gateway over its own engine and renderer, built as `tokentape serve` builds one
(`tokentape.served.build_served`): `build(engine, renderer, api_keys=("k",)).app`."""

from __future__ import annotations

from typing import Any

from tests.conftest import MODEL_NAME
from tokentape.engines.base import Engine
from tokentape.render.renderer import Renderer
from tokentape.served import Served, ServeSpec, build_served
from tokentape.store.base import TrajectoryStore


def build(
    engine: Engine, renderer: Renderer, *, model: str = MODEL_NAME, store: TrajectoryStore | None = None, **spec: Any
) -> Served:
    """`spec`: `ServeSpec`'s fields (keys, limits, policy...); `store`: instead of a `:memory:` one."""
    return build_served(ServeSpec(served_model_name=model, **spec), engine=engine, renderer=renderer, store=store)

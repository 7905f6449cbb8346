"""Command line: `tokentape VERB`, one module per verb (each defines its parser and registers it on the
app in `root`); the options several verbs share are defined once, in `options`."""

from __future__ import annotations

# Importing a verb's module registers it; this order is the order `tokentape --help` lists them in.
# isort: off
from tokentape.cli import serve, status, run, demo, doctor, rollout, train, export, view, verl_config  # noqa: F401

# isort: on
from tokentape.cli.root import app, main

__all__ = ["app", "main"]

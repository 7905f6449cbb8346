"""`tokentape view`: the token-level viewer of a gateway's sessions, served or as a static page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokentape.cli.options import TrainerKey, trainer_headers
from tokentape.cli.root import app


@app.command()
def view(
    url: Annotated[str, typer.Option(help="The gateway whose sessions to show.")] = "http://127.0.0.1:8000",
    out: Annotated[
        Path | None, typer.Option(help="Write a static HTML snapshot to this file instead of serving.")
    ] = None,
    port: Annotated[int, typer.Option(help="Port to serve the viewer on.")] = 8050,
    api_key: TrainerKey = None,
) -> None:
    """Show recorded sessions token by token: origin and loss mask by colour, logprob as heat, turns,
    branches as a tree, rewrites marked; hover a token for its ID, text and logprob."""
    import httpx

    from tokentape.viewer import static_page

    headers = trainer_headers(api_key)

    def snapshot() -> str:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:  # one connection for all
            listing = client.get("/sessions")
            if listing.status_code != 200:
                raise SystemExit(f"view failed: {listing.text}")
            listed = listing.json()["data"]
            exports = {
                s["session_id"]: client.get(f"/sessions/{s['session_id']}/export", params={"texts": "true"}).json()
                for s in listed
            }
        return static_page({"sessions": listed, "exports": exports})

    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(snapshot(), encoding="utf-8")
        typer.echo(f"{out}: a static snapshot of {url}")
        return
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    async def home(_: Request) -> HTMLResponse:
        return HTMLResponse(snapshot())

    typer.echo(f"tokentape viewer: http://127.0.0.1:{port}/ (sessions of {url}; reload to refresh)", err=True)
    uvicorn.run(Starlette(routes=[Route("/", home)]), host="127.0.0.1", port=port, log_level="warning")

"""Session keys, measured in-process on the embedded model (a measurement, not a test).

1. The route-by-key walk (tests/auth/walk.py): every route of the app with no key, a wrong key, the
   agent's session key, another session's key and a trainer key; what each reached. On a checkout
   from before session keys (no `tokentape.server.auth`), the agent holds the one kind of key there
   was, as agents did then, and the walk reports what it reached.
2. The guard's CPU per request (`Guard.admit`: headers, key, body of a small chat request), by key.
3. Constant time: checking a wrong key of the right length and of other lengths (trainer keys, and
   session keys with a wrong secret), median and spread of many runs each.

    python benchmarks/session_keys.py [--rounds 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.auth.walk import MODEL, TRAINER, walk  # noqa: E402

from tokentape.served import ServeSpec, build_served  # noqa: E402
from tokentape.server.middleware import Guard, GuardSettings  # noqa: E402

HAS_KEYS = importlib.util.find_spec("tokentape.server.auth") is not None
T = {"authorization": f"Bearer {TRAINER}"}
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}).encode()


async def the_walk() -> dict[str, Any]:
    served = build_served(ServeSpec(context_length=1024, api_keys=(TRAINER,)))
    gateway, app = served.gateway, served.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        keys: dict[str, str] = {}
        for session in ("ep-a", "ep-b", "ep-t"):
            created = (await http.post("/sessions", json={"session_id": session}, headers=T)).json()
            keys[session] = created.get("api_key", TRAINER)  # before session keys: the one key there was
        if HAS_KEYS:
            kinds = {
                "none": {},
                "wrong": {"authorization": f"Bearer tts.ep-a.{secrets.token_urlsafe(32)}"},
                "own": {"authorization": f"Bearer {keys['ep-a']}"},
                "other": {"x-api-key": keys["ep-b"]},
                "trainer": T,
            }
        else:
            kinds = {"none": {}, "wrong": {"authorization": "Bearer wrong"}, "own": T}
        result = await walk(
            app, http, kinds, lambda kind: "ep-t" if kind == "trainer" else "ep-a", check_store=HAS_KEYS
        )
    await gateway.aclose()
    return {
        "session_keys": HAS_KEYS,
        "routes": len({(m, p) for (_, m, p) in result.answers}),
        "calls": len(result.answers),
        "reached": {kind: len(result.reached(kind)) for kind in kinds},
        "agent_reached": result.reached("own"),
        "problems": len(result.problems) if HAS_KEYS else None,
        "seconds": round(result.seconds, 2),
    }


async def admit_cost(guard: Guard, path: str, headers: list[tuple[bytes, bytes]], rounds: int) -> float:
    """Median microseconds of CPU per `Guard.admit` over `rounds` calls, in batches."""
    scope_headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY)), *headers]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"refused: {message}")

    batches = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(rounds // 7):
            scope = {"type": "http", "method": "POST", "path": path, "headers": list(scope_headers)}
            await guard.admit(scope, receive, send)
            if HAS_KEYS:
                guard.release(scope)
        batches.append((time.process_time() - start) / (rounds // 7) * 1e6)
    return round(statistics.median(batches), 2)


async def check_timings(check: Any, offered: dict[str, bytes], rounds: int) -> dict[str, Any]:
    """Microseconds per call of `check` on each key: medians of 21 runs, the keys interleaved so the
    shared machine's ups and downs fall on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in offered}
    for _ in range(21):
        for name, key in offered.items():
            start = time.perf_counter()
            for _ in range(rounds):
                await check(key)
            samples[name].append((time.perf_counter() - start) / rounds * 1e6)
    return {
        name: {"median_us": round(statistics.median(s), 3), "iqr_us": round(_iqr(s), 3)} for name, s in samples.items()
    }


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


async def costs(rounds: int) -> dict[str, Any]:
    gateway = build_served(ServeSpec(context_length=1024)).gateway
    figures: dict[str, Any] = {}
    open_guard = Guard(None, GuardSettings())
    keyed_settings = GuardSettings(api_keys=[TRAINER])
    if HAS_KEYS:
        from tokentape.server.keys import SessionKeys

        keys = SessionKeys(gateway.sessions)
        open_guard = Guard(None, GuardSettings(), keys)
        keyed = Guard(None, keyed_settings, keys)
        await gateway.sessions.open("ep-a")
        session_key = await keys.issue((await gateway.sessions.get("ep-a")).tree)
    else:
        keyed = Guard(None, keyed_settings)
    chat = "/v1/chat/completions"
    figures["admit_us_open_no_key"] = await admit_cost(open_guard, chat, [], rounds)
    figures["admit_us_open_placeholder_key"] = await admit_cost(
        open_guard, chat, [(b"authorization", b"Bearer unused")], rounds
    )
    figures["admit_us_trainer_key"] = await admit_cost(
        keyed, chat, [(b"authorization", f"Bearer {TRAINER}".encode())], rounds
    )
    if HAS_KEYS:
        bearer = [(b"authorization", f"Bearer {session_key}".encode())]
        figures["admit_us_session_key_base_url"] = await admit_cost(
            keyed, "/sessions/ep-a/v1/chat/completions", bearer, rounds
        )
        figures["admit_us_session_key_root"] = await admit_cost(keyed, chat, bearer, rounds)
        secret = session_key.rsplit(".", 1)[1]
        last = "A" if secret[-1] != "A" else "B"
        figures["session_key_check"] = await check_timings(
            keys.check,
            {
                "wrong secret, right length": f"tts.ep-a.{secrets.token_urlsafe(32)}".encode(),
                "right but its last char": f"tts.ep-a.{secret[:-1]}{last}".encode(),
                "right but its first char": f"tts.ep-a.{last}{secret[1:]}".encode(),
                "wrong secret, 3x longer": f"tts.ep-a.{secrets.token_urlsafe(96)}".encode(),
                "wrong secret, 8 chars shorter (no key's shape)": f"tts.ep-a.{secrets.token_urlsafe(26)}".encode(),
            },
            rounds,
        )

        async def trainer(key: bytes) -> bool:
            return keyed.is_trainer_key(key)

        figures["trainer_key_check"] = await check_timings(
            trainer,
            {
                "wrong, right length": ("x" * len(TRAINER)).encode(),
                "right but its last char": f"{TRAINER[:-1]}X".encode(),
                "right but its first char": f"X{TRAINER[1:]}".encode(),
                "wrong, 1 char": b"x",
                "wrong, 4x longer": ("x" * 4 * len(TRAINER)).encode(),
            },
            rounds,
        )
    await gateway.aclose()
    return figures


async def main(args: argparse.Namespace) -> None:
    print("walk:", json.dumps(await the_walk()), flush=True)
    print("costs:", json.dumps(await costs(args.rounds), indent=1), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20_000)
    asyncio.run(main(parser.parse_args()))

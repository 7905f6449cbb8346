"""`make e2e-docker`: the repository's Dockerfile, built and started as the Deploy page says, on the
embedded model (no GPU). Python's standard library only, so it runs with any python3 beside Docker.

    python3 tests/e2e/docker_image.py [--tag tokentape:e2e] [--keep]

1. `docker build` (the first build compiles llama.cpp, about 6 minutes on 2 cores);
2. `docker run` with a trainer key and a named volume: /health answers, a chat completion in a session
   is recorded, its export's sampled tokens are the reply's;
3. `docker stop` returns within Docker's 10 s (the image drains for 8 s) and the gateway exits 0 (a
   SIGTERM drained, not a kill);
4. a host directory owned by another user mounted at /data: the container exits at once and says how
   to fix it; with `--user` set to the directory's owner it starts.

Exits 0 when every step passed, 1 with the step's output when one failed. Without a Docker daemon it
prints one SKIPPED line and exits 0 (the Makefile checks `docker info` first as well)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEY = "e2e-docker-trainer-key"


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise SystemExit(
            f"docker {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, body: dict[str, object] | None = None, timeout: float = 120) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {KEY}"})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        result: dict[str, object] = json.loads(answer.read())
        return result


def wait_healthy(base: str, container: str, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = docker("inspect", "-f", "{{.State.Running}}", container, check=False).stdout.strip()
        if state != "true":
            raise SystemExit(f"the container stopped before /health answered:\n{logs(container)}")
        try:
            call(f"{base}/health", timeout=3)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise SystemExit(f"/health did not answer within {seconds:.0f} s:\n{logs(container)}")


def logs(container: str) -> str:
    done = docker("logs", container, check=False)
    return (done.stdout + done.stderr)[-4000:]


def step(text: str) -> None:
    print(f"e2e-docker: {text}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="tokentape:e2e")
    parser.add_argument("--keep", action="store_true", help="keep the image and the volume afterwards")
    args = parser.parse_args()
    if docker("info", check=False).returncode != 0:
        print("make e2e-docker: SKIPPED: no Docker daemon answers here (`docker info` failed)")
        return 0
    suffix = f"{os.getpid()}"
    container, volume = f"tokentape-e2e-{suffix}", f"tokentape-e2e-{suffix}"

    started = time.monotonic()
    step(f"building {args.tag} (the first build compiles llama.cpp: minutes)")
    docker("build", "-t", args.tag, str(ROOT), timeout=3600)
    step(f"built in {time.monotonic() - started:.0f} s")

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        docker(
            "run", "-d", "--name", container, "-p", f"127.0.0.1:{port}:8000", "-e", f"TOKENTAPE_API_KEYS={KEY}",
            "-v", f"{volume}:/data", args.tag,
        )  # fmt: skip
        wait_healthy(base, container)
        step("/health answers")
        model = call(f"{base}/v1/models")["data"][0]["id"]  # type: ignore[index]
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = call(f"{base}/sessions/e2e/v1/chat/completions", body)
        sampled = reply["choices"][0]["token_ids"]  # type: ignore[index]
        branch = call(f"{base}/sessions/e2e/export")["branches"][0]  # type: ignore[index]
        recorded = [t for t, m in zip(branch["tokens"], branch["loss_mask"], strict=True) if m]
        assert recorded == sampled and 1 <= len(sampled) <= 4, (recorded, sampled)
        step(f"a chat completion recorded: {len(sampled)} sampled tokens, the export's are the reply's")

        stop_started = time.monotonic()
        docker("stop", container, timeout=60)
        took = time.monotonic() - stop_started
        code = docker("inspect", "-f", "{{.State.ExitCode}}", container).stdout.strip()
        assert took < 10 and code == "0", f"docker stop took {took:.1f} s, exit code {code}:\n{logs(container)}"
        step(f"docker stop: drained and exited 0 in {took:.1f} s")
        docker("rm", container)

        with tempfile.TemporaryDirectory(prefix="tokentape-e2e-data-") as host_dir:
            os.chmod(host_dir, 0o755)  # its owner's alone, as a fresh host directory is
            owner = f"{os.stat(host_dir).st_uid}:{os.stat(host_dir).st_gid}"
            refused = docker(
                "run", "--rm", "-e", f"TOKENTAPE_API_KEYS={KEY}", "-v", f"{host_dir}:/data", args.tag,
                check=False, timeout=60,
            )  # fmt: skip
            said = refused.stdout + refused.stderr
            assert refused.returncode == 1 and "cannot write to /data" in said and "--user" in said, said
            step("a host directory it cannot write: refused at start, with the fix named")
            docker(
                "run", "-d", "--name", container, "--user", owner, "-p", f"127.0.0.1:{port}:8000",
                "-e", f"TOKENTAPE_API_KEYS={KEY}", "-v", f"{host_dir}:/data", args.tag,
            )  # fmt: skip
            wait_healthy(base, container)
            call(f"{base}/sessions/e2e-user/v1/chat/completions", body)
            docker("stop", container, timeout=60)
            assert (Path(host_dir) / "tokentape.sqlite3").exists()
            step(f"--user {owner}: serves, and the store is in the host directory")
    finally:
        docker("rm", "-f", container, check=False)
        if not args.keep:
            docker("volume", "rm", "-f", volume, check=False)
    step(f"passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

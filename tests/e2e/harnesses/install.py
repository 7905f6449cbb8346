"""The coding-agent harnesses `make e2e-harnesses` runs, at pinned versions, installed once into a cache.

Each goes to `~/.cache/tokentape/harnesses/<name>-<version>` (`TOKENTAPE_HARNESSES` moves the root):
the npm packages with `npm install --prefix`, mini-swe-agent in a virtualenv of its own. A directory
with its `.installed` stamp is reused as it is; one without (an install cut short) is removed and
installed again. Each install is checked by running the program's `--version`.

    python tests/e2e/harnesses/install.py            # all four
    python tests/e2e/harnesses/install.py codex      # some
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "TOKENTAPE_HARNESSES"
STAMP = ".installed"


@dataclass(frozen=True)
class Harness:
    name: str
    version: str
    package: str  # the npm package, or the PyPI distribution (pypi=True)
    program: str
    pypi: bool = False

    @property
    def directory(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}"

    @property
    def executable(self) -> Path:
        if self.pypi:
            return self.directory / "venv" / "bin" / self.program
        return self.directory / "node_modules" / ".bin" / self.program

    @property
    def installed(self) -> bool:
        return (self.directory / STAMP).is_file() and self.executable.exists()


HARNESSES = {
    h.name: h
    for h in (
        Harness("claude-code", "2.1.328", "@anthropic-ai/claude-code", "claude"),
        Harness("codex", "0.169.0", "@openai/codex", "codex"),
        Harness("opencode", "1.18.33", "opencode-ai", "opencode"),
        Harness("mini-swe-agent", "2.4.6", "mini-swe-agent", "mini", pypi=True),
    )
}


def cache_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or Path.home() / ".cache" / "tokentape" / "harnesses")


def install(harness: Harness) -> Path:
    """Install `harness` unless its cached directory is complete; its directory."""
    target = harness.directory
    if harness.installed:
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    if harness.pypi:
        subprocess.run([sys.executable, "-m", "venv", str(target / "venv")], check=True)
        pip = [str(target / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"{harness.package}=={harness.version}"], check=True)
    else:
        npm = ["npm", "install", "--prefix", str(target), "--no-fund", "--no-audit", "--loglevel=error"]
        subprocess.run([*npm, f"{harness.package}@{harness.version}"], check=True)
    shown = subprocess.run(
        [str(harness.executable), "--version"], capture_output=True, text=True, timeout=60, env=_quiet_env(target)
    )
    if harness.version not in shown.stdout + shown.stderr:
        raise SystemExit(f"{harness.name}: `--version` did not name {harness.version}: {shown.stdout}{shown.stderr}")
    (target / STAMP).write_text(f"{harness.package} {harness.version}\n")
    return target


def _quiet_env(home: Path) -> dict[str, str]:
    # mini-swe-agent asks for a model on its first run; a fresh HOME keeps the user's configs out
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "MSWEA_CONFIGURED": "true"}


def main(names: list[str]) -> None:
    for name in names or list(HARNESSES):
        harness = HARNESSES[name]
        start, cached = time.monotonic(), harness.installed
        install(harness)
        how = "cached" if cached else f"installed in {time.monotonic() - start:.0f} s"
        print(f"{harness.name} {harness.version}: {harness.directory} ({how})")


if __name__ == "__main__":
    main(sys.argv[1:])

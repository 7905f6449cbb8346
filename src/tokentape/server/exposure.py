"""What `tokentape serve` may start as, decided before anything loads: a gateway reachable from other
machines needs a trainer key (else anyone there may reward, finish, export and load weights), and
weights load only from directories the operator names."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from pathlib import Path

__all__ = ["OpenModeRefused", "check_exposure", "default_weights_dirs", "loopback"]


class OpenModeRefused(ValueError):
    """Serving without a trainer key on an address other machines reach, without --insecure-open."""


def loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve to anything
        return False


def check_exposure(host: str, trainer_keys: Sequence[str], *, insecure_open: bool) -> str | None:
    """None when the settings are safe; a warning to print when `insecure_open` overrides; raises
    OpenModeRefused when a non-loopback host has no trainer key and no override."""
    if trainer_keys or loopback(host):
        return None
    if not insecure_open:
        raise OpenModeRefused(
            f"--host {host} is reachable from other machines and no trainer key is set: anyone there could "
            "reward, finish and export sessions and load weights. Give --api-key (or TOKENTAPE_API_KEYS), "
            "bind 127.0.0.1, or pass --insecure-open on a network you trust"
        )
    return f"serving on {host} with no trainer key (--insecure-open): every route is open to whoever reaches it"


def default_weights_dirs(cache: Path, runs: Path = Path("runs")) -> list[Path]:
    """Where `serve` loads weights from unless told otherwise: tokentape's cache (F32 copies) and the
    runs folder `tokentape train` writes its adapters under, both resolved from here."""
    return [cache.resolve(), runs.resolve()]

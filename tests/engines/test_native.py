"""llama-cpp-python is imported with OpenMP's spin set for the moment its runtime loads, and only
where the operator set none; the process's environment is left as it was. Each case runs in a fresh
interpreter: libgomp reads its settings once, when it is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
seen = []
class Watch:  # records the environment at the moment llama_cpp is imported
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp":
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
        return None
sys.meta_path.insert(0, Watch())
from tokentape.native import llama_cpp
module = llama_cpp()
assert llama_cpp() is module  # imported once
maps = open("/proc/self/maps").read()
print(json.dumps({
    "set_for_import": seen,
    "after": {name: os.environ.get(name) for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
    "libgomp_loaded": "libgomp" in maps,
}))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_runtime_loads_with_a_short_spin_and_the_environment_is_restored() -> None:
    from tokentape.native import OPENMP_SPIN

    found = _probe({})
    assert found["set_for_import"] == [OPENMP_SPIN]
    assert found["after"] == {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None}
    assert found["libgomp_loaded"]  # the import loaded the runtime, while the setting stood


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_an_operators_setting_is_kept(env: dict[str, str]) -> None:
    found = _probe(env)
    assert found["set_for_import"] == [env.get("GOMP_SPINCOUNT")]  # as the operator left it
    after = found["after"]
    assert isinstance(after, dict)
    assert {name: after[name] for name in env} == env

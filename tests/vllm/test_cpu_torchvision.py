"""The torchvision shim of the vLLM virtualenv (`cpu_torchvision.py`): torchvision imports on the CPU
torch and its image transforms run, its compiled operators still fail as torchvision says they do, and a
process that never imports torchvision does not pay for the hook (no torch imported at start)."""

from __future__ import annotations

import subprocess

import pytest

from tests.vllm.conftest import VLLM_PYTHON, _vllm_env

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="a real vLLM runs under `make e2e-vllm` only (minutes of CPU; not part of make test)"
)

CHECK = """
import sys
assert "torch" not in sys.modules, "the hook imported torch at start"
import torch, torchvision
from torchvision.transforms.v2 import functional
from transformers.models.qwen2_vl import Qwen2VLImageProcessor
from PIL import Image
grid = Qwen2VLImageProcessor()(images=[Image.new("RGB", (1280, 800))], return_tensors="pt")["image_grid_thw"]
assert grid.tolist() == [[1, 56, 90]], grid
try:
    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
except RuntimeError as exc:
    assert "Couldn't load custom C++ ops" in str(exc), exc
else:
    raise AssertionError("nms ran without torchvision's compiled operators")
print("ok", torchvision.__version__)
"""


def test_torchvision_imports_on_the_cpu_torch_and_its_operators_still_refuse() -> None:
    assert VLLM_PYTHON
    done = subprocess.run(
        [VLLM_PYTHON, "-c", CHECK], capture_output=True, text=True, env=_vllm_env(), timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ")

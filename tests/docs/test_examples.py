"""The complete programs the trainer guides include (examples/trl, examples/skyrl, examples/verl) run as
a reader runs them, with tiny settings on this CPU: a page that includes one goes red here when it stops
running.

- TRL: `examples/trl/grpo.py`, one GRPOTrainer step in a subprocess, on the embedded model.
- SkyRL: `examples/skyrl/run.sh` runs under bash with `python` caught at the trainer's entrypoint: its
  dataset is written, and the arguments bash hands SkyRL go through tokentape's `split_args`, SkyRL's
  config and its `validate_cfg`, as `skyrl_main.main` does before it starts Ray. The agent then runs
  through `TokentapeGenerator` on rows of that dataset, read by SkyRL's own `PromptDataset`, a scripted
  inference client answering (SkyRL's servers need GPUs).
- verl: `examples/verl/run.sh` the same way, its arguments composed with verl's own Hydra config; the
  YAML it names is the packaged file, by an absolute path.

Each page includes its files (pymdownx.snippets), and the test checks that it does."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CAUGHT = "tokentape-docs-caught-argv"


def run_script(script: Path, tmp_path: Path, entrypoint: str) -> list[str]:
    """Runs `script` with bash as written, `python` being this interpreter except for `-m entrypoint`,
    whose arguments (as bash expanded them) are returned instead of starting the trainer."""
    shims = tmp_path / "bin"
    shims.mkdir()
    out = tmp_path / "argv"
    shim = f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "{entrypoint}" ]; then
    shift 2
    for arg in "$@"; do printf '%s\\0' "$arg"; done > "{out}"
    exit 0
fi
exec "{sys.executable}" "$@"
"""
    for name in ("python", "python3"):
        (shims / name).write_text(shim)
        (shims / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "HOME": str(tmp_path / "home"),
    }
    done = subprocess.run(
        ["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.exists(), f"{script.name} never started {entrypoint}:\n{done.stdout}{done.stderr}"
    return out.read_text().split("\0")[:-1]


def included(page: str) -> set[str]:
    """The files a docs page includes with pymdownx.snippets (`--8<-- "path"`)."""
    return set(re.findall(r'^--8<-- "([^"]+)"$', (ROOT / "docs" / page).read_text(), re.M))


def test_each_trainer_page_includes_its_complete_program() -> None:
    assert {"examples/trl/grpo.py"} <= included("guides/trl.md")
    assert {"examples/skyrl/agents.py", "examples/skyrl/dataset.py", "examples/skyrl/run.sh"} <= included(
        "guides/skyrl.md"
    )
    assert {"examples/verl/agents.py", "examples/verl/dataset.py", "examples/verl/run.sh"} <= included("guides/verl.md")


# ---- TRL ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_the_trl_program_takes_a_grpo_step(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    out = tmp_path / "run"
    tiny = ["--steps", "1", "--group-size", "2", "--max-tokens", "8", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "trl/grpo.py"), *tiny],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    reward = float(line.rsplit(" ", 1)[1])
    assert line.startswith("step 1: mean reward ") and reward in (0.0, 0.5, 1.0)  # two episodes, 0 or 1 each
    (adapter,) = (out / "adapters").glob("*.gguf")  # PushLora wrote the step's LoRA and pushed it
    assert adapter.stat().st_size > 0


# ---- SkyRL --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def skyrl_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    pytest.importorskip("skyrl")
    tmp = tmp_path_factory.mktemp("skyrl")
    argv = run_script(EXAMPLES / "skyrl/run.sh", tmp, "skyrl.train.entrypoints.main_base")
    return argv, tmp / "home/data/tokentape-arithmetic"


def test_the_skyrl_launch_passes_skyrls_own_validation(skyrl_run: tuple[list[str], Path]) -> None:
    from tokentape.integrations.skyrl_main import split_args  # first: skyrl imports on Python 3.11

    from skyrl.train.config import SkyRLTrainConfig  # isort: skip
    from skyrl.train.utils import validate_cfg  # isort: skip

    argv, data = skyrl_run
    assert argv[0] == "trainer.override_entrypoint=tokentape.integrations.skyrl_main"
    args, keys = split_args(argv)
    cfg = SkyRLTrainConfig.from_cli_overrides(args)
    validate_cfg(cfg)  # what the entrypoint runs before Ray: the command as the page shows it passes
    assert keys["agent"] == f"{ROOT}/examples/skyrl/agents.py:solve"
    assert list(cfg.data.train_data) == [str(data / "train.parquet")]
    assert list(cfg.data.val_data) == [str(data / "validation.parquet")]
    assert (data / "train.parquet").exists() and (data / "validation.parquet").exists()
    assert cfg.generator.max_turns > 1 and cfg.generator.max_input_length > cfg.trainer.max_prompt_length


class ScriptedClient:
    """SkyRL's inference client, scripted: each call answers the sum its prompt asks, read back from the
    prompt's token IDs, as `Answer: N` and the end of turn (SkyRL's servers need GPUs)."""

    def __init__(self, tokenizer: Any, end: int) -> None:
        self.tokenizer, self.end = tokenizer, end
        self.answers: list[list[int]] = []

    async def generate(self, input_batch: dict[str, Any], model: str | None = None) -> Any:
        from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineOutput

        (prompt,) = input_batch["prompt_token_ids"]
        a, b = (int(n) for n in re.findall(r"What is (\d+) \+ (\d+)\?", self.tokenizer.decode(prompt))[-1])
        tokens = [*self.tokenizer.encode(f"Answer: {a + b}", add_special_tokens=False), self.end]
        self.answers.append(tokens)
        return InferenceEngineOutput(
            responses=[""],
            response_ids=[tokens],
            stop_reasons=["stop"],
            response_logprobs=[[-0.5] * len(tokens)],
            prompt_logprobs=None,
            rollout_expert_indices=None,
        )

    async def finish_session(self, session_id: str) -> None:
        return None


async def test_the_skyrl_agent_runs_through_the_generator_on_the_dataset(
    skyrl_run: tuple[list[str], Path], tmp_path: Path, model_path: Path
) -> None:
    from tokentape.integrations.skyrl import TokentapeGenerator
    from tokentape.integrations.skyrl_main import split_args

    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend  # isort: skip
    from skyrl.train.config import SkyRLTrainConfig  # isort: skip
    from skyrl.train.dataset import PromptDataset  # isort: skip
    from skyrl.train.generators.utils import prepare_generator_input  # isort: skip
    from skyrl.utils.tok import get_tokenizer  # isort: skip
    from tests.support.models import gguf_tokenizer_dir

    argv, data = skyrl_run
    args, keys = split_args(argv)
    cfg = SkyRLTrainConfig.from_cli_overrides([*args, "generator.n_samples_per_prompt=2"])
    hf_dir = gguf_tokenizer_dir(model_path, tmp_path)  # the embedded model's tokenizer stands in for the policy's
    tokenizer = get_tokenizer(str(hf_dir), padding_side="left")
    dataset = PromptDataset([str(data / "train.parquet")], tokenizer, cfg.trainer.max_prompt_length, num_workers=1)
    rows = dataset.collate_fn([dataset[i] for i in range(2)])
    sampling = get_sampling_params_for_backend("vllm", cfg.generator.sampling_params)
    batch, _ = prepare_generator_input(rows, 2, sampling, "arithmetic", "train", 1)

    client = ScriptedClient(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    generator = TokentapeGenerator(cfg.generator, tokenizer, client, tokenizer_dir=str(hf_dir), **keys)
    out = await generator.generate(batch)

    truths = [row["env_extras"]["reward_spec"]["ground_truth"] for row in rows for _ in range(2)]
    assert [int(t) for t in truths] == [
        sum(map(int, re.findall(r"\d+", r["prompt"][0]["content"])[:2])) for r in rows for _ in range(2)
    ]
    assert out["rewards"] == [1.0] * 4  # the agent read each row's ground truth and the scripted answers
    assert out["tokentape_status"] == ["done"] * 4  # type: ignore[typeddict-item]
    # each row's response is the scripted answer to its own question (the trajectories run concurrently)
    answers = [[*tokenizer.encode(f"Answer: {t}", add_special_tokens=False), client.end] for t in truths]
    assert out["response_ids"] == answers and sorted(map(tuple, client.answers)) == sorted(map(tuple, answers))
    assert all(set(m) == {1} for m in out["loss_masks"])


# ---- verl ---------------------------------------------------------------------------------------------


def test_the_verl_launch_composes_with_verls_config_and_names_the_packaged_yaml(tmp_path: Path) -> None:
    pytest.importorskip("verl")
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tokentape.integrations import verl as tape_verl

    argv = run_script(EXAMPLES / "verl/run.sh", tmp_path, "verl.trainer.main_ppo")
    data = tmp_path / "home/data/tokentape-arithmetic"
    config_dir = Path(verl.__file__).parent / "trainer/config"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=argv)  # an unknown key fails here
    GlobalHydra.instance().clear()
    agent = cfg.actor_rollout_ref.rollout.agent
    assert agent.default_agent_loop == "tokentape_agent"
    assert Path(agent.agent_loop_config_path).is_absolute()
    assert Path(agent.agent_loop_config_path).samefile(tape_verl.CONFIG_PATH)  # the packaged file
    assert f"{ROOT}/examples/verl/agents.py:solve" == cfg.ray_kwargs.ray_init.runtime_env.env_vars.TOKENTAPE_AGENT
    assert cfg.data.train_files == str(data / "train.parquet") and (data / "train.parquet").exists()
    assert cfg.data.val_files == str(data / "test.parquet") and (data / "test.parquet").exists()
    assert shlex.join(argv).count("=") == len(argv)  # every argument a key=value override

"""SkyRL's training entrypoint with tokentape's generator: SkyRL's `main_base` hands over to this
module when given `trainer.override_entrypoint=tokentape.integrations.skyrl_main` (or run it as
`python -m tokentape.integrations.skyrl_main`), with the usual SkyRL keys and tokentape's own:

    tokentape.agent=my_pkg.agents:solve      # required (or the TOKENTAPE_AGENT environment variable)
    tokentape.rewrite_policy=tape            # tape, fork, strict
    tokentape.overflow_reward=0.0            # a rollout whose context filled up
    tokentape.error_reward=0.0               # a rollout that failed (trained on nowhere)
    tokentape.fail_on_engine_error=false     # true: SkyRL's inference failing fails the step
    tokentape.logprobs_mode=raw_logprobs     # what SkyRL's vLLM servers report
    tokentape.store=:memory:                 # a SQLite path keeps every tape
    tokentape.tokenizer_dir=...              # default: the policy model's path

Everything else is SkyRL's: `BasePPOExp` builds the inference client, the trainer and the workers;
only `get_generator` differs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

# isort: off
from tokentape.integrations.skyrl import TokentapeGenerator  # first: it makes skyrl importable on 3.11

import ray
from skyrl.backends.skyrl_train.inference_servers.utils import resolve_policy_model_name
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import initialize_ray
# isort: on

__all__ = ["TokentapeExp", "main", "split_args"]

PREFIX = "tokentape."
KEYS = {
    "agent": str,
    "rewrite_policy": str,
    "overflow_reward": float,
    "error_reward": float,
    "fail_on_engine_error": lambda v: str(v).lower() in ("1", "true", "yes"),
    "logprobs_mode": str,
    "store": str,
    "tokenizer_dir": str,
}


def split_args(args: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """SkyRL's overrides, and tokentape's keys (typed); `trainer.override_entrypoint` dropped."""
    skyrl, keys = [], {}
    for arg in args:
        if arg.startswith("trainer.override_entrypoint="):
            continue
        if arg.startswith(PREFIX):
            name, _, value = arg[len(PREFIX) :].partition("=")
            if name not in KEYS:
                raise SystemExit(
                    f"unknown key {arg.split('=')[0]}: tokentape takes {', '.join(PREFIX + k for k in KEYS)}"
                )
            keys[name] = KEYS[name](value)  # type: ignore[operator]
        else:
            skyrl.append(arg)
    if "agent" not in keys and os.environ.get("TOKENTAPE_AGENT"):
        keys["agent"] = os.environ["TOKENTAPE_AGENT"]
    if "agent" not in keys:
        raise SystemExit("tokentape.agent=module:function is required (the agent to train)")
    return skyrl, keys


class TokentapeExp(BasePPOExp):  # type: ignore[misc]
    """SkyRL's experiment, its generator tokentape's."""

    def __init__(self, cfg: SkyRLTrainConfig, tokentape: dict[str, Any]) -> None:
        self.tokentape = dict(tokentape)
        super().__init__(cfg)

    def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> TokentapeGenerator:
        keys = dict(self.tokentape)
        keys.setdefault("tokenizer_dir", str(cfg.trainer.policy.model.path))
        return TokentapeGenerator(
            cfg.generator,
            tokenizer,
            inference_engine_client,
            policy_model_name=resolve_policy_model_name(cfg),
            **keys,
        )


@ray.remote(num_cpus=1)
def tokentape_entrypoint(cfg: SkyRLTrainConfig, tokentape: dict[str, Any]) -> None:
    TokentapeExp(cfg, tokentape).run()  # not on the head node, as SkyRL's own entrypoint


def main() -> None:
    args, keys = split_args(sys.argv[1:])
    cfg = SkyRLTrainConfig.from_cli_overrides(args)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(tokentape_entrypoint.remote(cfg, keys))


if __name__ == "__main__":
    main()

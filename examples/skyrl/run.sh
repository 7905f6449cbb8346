#!/usr/bin/env bash
# GRPO with SkyRL, its rollouts through tokentape's generator: one node with 8 GPUs, SkyRL installed with
# its GPU extras and tokentape beside it (docs/guides/skyrl.md, "Install"). Run from the repository root:
#
#   bash examples/skyrl/run.sh
#
# The dataset is examples/skyrl/dataset.py's; the agent examples/skyrl/agents.py's `solve`, named by its
# file path (on several nodes, name an installed package's `module:function` instead). Every key below is
# one of SkyRL 0.3.0's own or tokentape's; the docs test parses them with SkyRL's config and runs its
# validate_cfg, as the entrypoint does before it starts Ray. The batch sizes are an example.
set -euo pipefail

DATA_DIR="${DATA_DIR:-$HOME/data/tokentape-arithmetic}"
MODEL="${MODEL:-Qwen/Qwen2.5-3B-Instruct}"
python examples/skyrl/dataset.py "$DATA_DIR"

# generator.max_turns: SkyRL's validate_cfg takes max_input_length above trainer.max_prompt_length only
# for multi-turn generation (max_turns > 1); tokentape's generator itself does not count turns.
python -m skyrl.train.entrypoints.main_base \
    trainer.override_entrypoint=tokentape.integrations.skyrl_main \
    tokentape.agent="$PWD/examples/skyrl/agents.py:solve" \
    data.train_data="['$DATA_DIR/train.parquet']" \
    data.val_data="['$DATA_DIR/validation.parquet']" \
    trainer.policy.model.path="$MODEL" \
    trainer.algorithm.advantage_estimator=grpo \
    trainer.placement.colocate_all=true \
    trainer.placement.policy_num_gpus_per_node=8 \
    generator.inference_engine.num_engines=8 \
    generator.inference_engine.tensor_parallel_size=1 \
    trainer.epochs=1 \
    trainer.train_batch_size=64 \
    trainer.policy_mini_batch_size=32 \
    trainer.max_prompt_length=512 \
    generator.n_samples_per_prompt=8 \
    generator.max_turns=8 \
    generator.max_input_length=4096 \
    generator.sampling_params.max_generate_length=1024 \
    trainer.logger=console

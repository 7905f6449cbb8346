#!/usr/bin/env bash
# GRPO with verl, its rollouts through tokentape's agent loop: one node with 8 GPUs, verl installed with
# its torch and vLLM, tokentape beside it (docs/guides/verl.md, "Install"). Run from the repository root:
#
#   bash examples/verl/run.sh
#
# The dataset is examples/verl/dataset.py's; the agent examples/verl/agents.py's `solve`, named by its
# absolute file path. verl reads agent_loop_config_path inside each AgentLoopWorker (Ray actors, on
# whichever node), so it is the absolute path of the YAML tokentape ships: `tokentape verl-config` prints
# it. On several nodes, install tokentape at the same path on each (one image, or one virtualenv path),
# or put a copy of the YAML on a shared filesystem and give that path. The docs test composes these keys
# with verl 0.9.1's own Hydra config. The batch sizes and learning rate are an example.
set -euo pipefail

DATA_DIR="${DATA_DIR:-$HOME/data/tokentape-arithmetic}"
MODEL="${MODEL:-Qwen/Qwen2.5-3B-Instruct}"
python examples/verl/dataset.py "$DATA_DIR"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=4096 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$(tokentape verl-config)" \
    actor_rollout_ref.rollout.agent.default_agent_loop=tokentape_agent \
    +ray_kwargs.ray_init.runtime_env.env_vars.TOKENTAPE_AGENT="$PWD/examples/verl/agents.py:solve" \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=15 \
    trainer.logger=console

"""Trainers' own entry points, served by tokentape: `atropos` (an environment's server manager),
`openrlhf` (an agent executor), `verl` (an agent loop), `skyrl` (a generator), `trl` (a rollout
function). Each needs its framework installed. `trainer_engine` is the engine a trainer's own servers
make (sampling the trainer's, weight syncs resumed), which `verl_engine` and `skyrl_engine` specialise."""

"""Trainers' own entry points, served by tokentape: `atropos` (an environment's server manager) and
`openrlhf` (an agent executor). Each needs its framework installed (atroposlib, openrlhf)."""

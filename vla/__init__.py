"""Trainer for vision-language-action robot policies (pi0, OpenVLA-style) on LeRobot datasets.

Subpackages: `vla.models` (nn.Modules only), `vla.data` (LeRobot v3.0 datasets, processing),
`vla.training` (Accelerate, checkpoints, the fit loop), `vla.eval` (metrics, rollouts).
Importing `vla` itself is cheap: subpackages load on demand.
"""

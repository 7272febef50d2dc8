"""Observability for Mixture-of-Experts training with Megatron-core and NeMo-RL-style loops."""

__version__ = "0.1.0"

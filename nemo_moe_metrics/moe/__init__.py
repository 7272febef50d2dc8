"""MoE metrics: router hooks, aux-loss metrics, balance statistics, cross-rank reduction."""

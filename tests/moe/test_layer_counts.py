"""Kept picks (``moe.layer_counts``): forwards counted together equal each forward counted alone.

The oracle is numpy's ``bincount`` per forward over the real rows (routed counts, tokens) and
over every row (executed counts), summed per layer.
"""

from __future__ import annotations

import numpy as np
import torch

from nemo_moe_metrics.moe.deferred import ConstantTensors
from nemo_moe_metrics.moe.layer_counts import (
    KeptPicks,
    LayerAccumulator,
    LayerBuffers,
    forward_counts,
)


def test_forwards_counted_together_equal_each_forward_counted_alone():
    gen = torch.Generator().manual_seed(0)
    # Layers 0 and 3 hand ids (two widths: two batches), layer 1 a [T, E] map (megatron's)
    widths = {0: 8, 1: 8, 3: 6}
    accs = [LayerAccumulator(layer, e, 2, torch.device("cpu")) for layer, e in widths.items()]
    kept, constants = KeptPicks(), ConstantTensors()
    buffers = LayerBuffers(accs, torch.device("cpu"), constants)
    routed = {layer: np.zeros(e, np.int64) for layer, e in widths.items()}
    executed = {layer: np.zeros(e, np.int64) for layer, e in widths.items()}
    tokens = dict.fromkeys(widths, 0)
    per_forward: list[tuple[int, tuple[int, ...]]] = []
    for forward in range(6):
        for acc in accs:
            maps = acc.layer_id == 1
            rows = 16 if maps else int(torch.randint(3, 40, (1,), generator=gen))
            ids = torch.rand(rows, acc.num_experts, generator=gen).argsort(dim=1)[:, :2]
            picks = torch.zeros(rows, 8, dtype=torch.bool).scatter_(1, ids, True) if maps else ids
            # Forwards with and without a mask
            valid = None if forward % 2 else torch.rand(rows, generator=gen) > 0.3
            kept.keep(acc, picks, valid)
            real = np.ones(rows, bool) if valid is None else valid.numpy()
            alone = np.bincount(ids[real].reshape(-1).numpy(), minlength=acc.num_experts)
            routed[acc.layer_id] += alone
            executed[acc.layer_id] += np.bincount(ids.reshape(-1), minlength=acc.num_experts)
            tokens[acc.layer_id] += int(real.sum())
            per_forward.append((acc.layer_id, tuple(alone.tolist())))
    together = []
    for batch in kept.take():
        counts, every, real_tokens = forward_counts(batch, constants)
        buffers.add_forwards(batch.owners, counts, every, real_tokens)
        together += [
            (a.layer_id, tuple(c)) for a, c in zip(batch.owners, counts.tolist(), strict=True)
        ]
    assert kept.take() == []
    # Each forward's own routed counts (router health's microbatch balance reads them)
    assert sorted(together) == sorted(per_forward)
    buffers.payload()
    for acc in accs:
        layer = acc.layer_id
        assert np.array_equal(acc.counts.numpy(), routed[layer]), layer
        assert np.array_equal(acc.executed.numpy(), executed[layer]), layer
        assert int(acc.tokens) == tokens[layer], layer
    buffers.reset()
    assert not buffers.state.any() and not any(acc.counted for acc in accs)

"""DeepSeek's expert-parallel load balancer (EPLB), as published, in numpy.

The algorithm of github.com/deepseek-ai/EPLB (``eplb.py``, MIT licence), written again here
as pure functions of arrays (no torch, no torch.distributed) so that a placement plan can be
computed from a run's stored expert loads anywhere:

1. hierarchical policy (the number of nodes divides the number of expert groups): pack the
   expert groups onto nodes so that node loads are balanced; inside each node, replicate the
   expert with the highest load per replica until the node holds its share of physical
   experts; pack the physical experts onto the node's GPUs, balanced;
2. global policy (otherwise): the same with one group and one node.

Packing is greedy: items in order of decreasing weight, each to the lightest pack that still
has room, every pack holding the same number of items. Ties break as the reference's do (the
first pack, the first expert), and sums are float32 as there, so plans equal the reference's
bit for bit (tests/placement/test_eplb.py reproduces its published example).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "EplbPlan",
    "balanced_packing",
    "check_layout",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replicate_experts",
    "uses_hierarchical_policy",
]


@dataclass(frozen=True)
class EplbPlan:
    """A placement: ``physical_to_logical [L, P]`` (GPU ``g`` holds physical slots
    ``g*P/G ... (g+1)*P/G - 1``), ``logical_to_physical [L, E, max replicas]`` (-1 padded),
    ``replica_count [L, E]`` (copies of each logical expert, >= 1)."""

    physical_to_logical: np.ndarray
    logical_to_physical: np.ndarray
    replica_count: np.ndarray


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the ``n`` items of each row of ``weight [X, n]`` into ``num_packs`` packs of
    ``n / num_packs`` items each, greedily balancing the packs' weights.

    Returns ``(pack_index [X, n], rank_in_pack [X, n])``. All rows are packed at once: the
    greedy's k-th step places every row's k-th heaviest item.
    """
    rows, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), np.int64)
    w = weight.astype(np.float32, copy=False)
    order = np.argsort(-w, axis=1, kind="stable")
    pack_index = np.full((rows, n), -1, np.int64)
    rank_in_pack = np.full((rows, n), -1, np.int64)
    pack_weight = np.zeros((rows, num_packs), np.float32)
    pack_items = np.zeros((rows, num_packs), np.int64)
    row = np.arange(rows)
    for k in range(n):
        item = order[:, k]
        # The lightest pack with room; argmin takes the first of equals, as ``min`` does.
        pack = np.argmin(np.where(pack_items < per_pack, pack_weight, np.inf), axis=1)
        pack_index[row, item] = pack
        rank_in_pack[row, item] = pack_items[row, pack]
        pack_weight[row, pack] += w[row, item]
        pack_items[row, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(
    weight: np.ndarray, num_physical: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate the ``E`` experts of each row of ``weight [X, E]`` into ``num_physical``
    replicas, each extra replica going to the expert with the highest load per replica.

    Returns ``(physical_to_logical [X, P], replica_rank [X, P], replica_count [X, E])``.
    """
    rows, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} experts")
    w = weight.astype(np.float32, copy=False)
    phy2log = np.broadcast_to(np.arange(num_physical), (rows, num_physical)).copy()
    rank = np.zeros((rows, num_physical), np.int64)
    count = np.ones((rows, num_logical), np.int64)
    row = np.arange(rows)
    for i in range(num_logical, num_physical):
        hottest = np.argmax(w / count.astype(np.float32), axis=1)
        phy2log[:, i] = hottest
        rank[:, i] = count[row, hottest]
        count[row, hottest] += 1
    return phy2log, rank, count


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hierarchical policy on ``weight [L, E]``: groups to nodes, replicas within nodes,
    physical experts to GPUs. Returns ``(physical_to_logical [L, P], replica_rank [L, P],
    replica_count [L, E])``; the divisibility it needs is checked by :func:`check_layout`."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    w = weight.astype(np.float32, copy=False)

    # 1. Expert groups onto nodes. log2mlog: a logical expert's slot in node-major order.
    group_load = w.reshape(num_layers, num_groups, group_size).sum(-1, dtype=np.float32)
    group_pack, group_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
        + np.arange(group_size)
    ).reshape(num_layers, num_logical)
    mlog2log = _inverse(log2mlog)

    # 2. Replicas within each node: rows are (layer, node).
    per_node = num_logical // num_nodes
    node_load = np.take_along_axis(w, mlog2log, axis=1).reshape(-1, per_node)
    phy2mlog, phy_rank, mlog_count = replicate_experts(node_load, num_physical // num_nodes)

    # 3. Physical experts onto the node's GPUs, each replica carrying an equal share.
    phy_load = np.take_along_axis(node_load / mlog_count.astype(np.float32), phy2mlog, axis=1)
    gpu, rank_on_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * per_gpu + rank_on_gpu)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(num_layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * per_node)[None, :, None]).reshape(
        num_layers, -1
    )
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphy_rank = np.take_along_axis(phy_rank, pphy2phy, axis=1).reshape(num_layers, -1)
    count = np.take_along_axis(mlog_count.reshape(num_layers, -1), log2mlog, axis=1)
    return pphy2log, pphy_rank, count


def uses_hierarchical_policy(num_groups: int, num_nodes: int) -> bool:
    """The reference's choice: hierarchical when the nodes divide the expert groups."""
    return num_groups % num_nodes == 0


def check_layout(
    num_experts: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Raise ValueError, naming the option to change, when the layout admits no plan."""
    if num_gpus < 1 or num_nodes < 1 or num_groups < 1:
        raise ValueError("--ep-size, --nodes and --groups must be >= 1")
    if num_physical < num_experts:
        raise ValueError("--redundant-experts must be >= 0")
    if num_physical % num_gpus:
        first = (-num_experts) % num_gpus
        raise ValueError(
            f"{num_experts} experts + {num_physical - num_experts} redundant experts = "
            f"{num_physical} do not divide over --ep-size {num_gpus} GPUs; change "
            f"--redundant-experts (to {first}, {first + num_gpus}, {first + 2 * num_gpus}, ...) "
            "or --ep-size"
        )
    if num_gpus % num_nodes:
        raise ValueError(
            f"--ep-size {num_gpus} GPUs do not divide over --nodes {num_nodes}; change --nodes"
        )
    if num_experts % num_groups:
        raise ValueError(
            f"--groups {num_groups} does not divide the {num_experts} experts; pass a divisor "
            f"of {num_experts} (the model's expert groups, or 1 for none)"
        )


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> EplbPlan:
    """EPLB's entry point: a plan for ``weight [L, E]`` (each layer's load per expert) with
    ``num_replicas`` physical experts over ``num_gpus`` GPUs in ``num_nodes`` nodes;
    hierarchical when ``num_nodes`` divides ``num_groups``, else global (one group, one node).
    """
    weight = np.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {weight.shape}")
    num_layers, num_logical = weight.shape
    check_layout(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    if not uses_hierarchical_policy(num_groups, num_nodes):
        num_groups, num_nodes = 1, 1
    phy2log, rank, count = rebalance_experts_hierarchical(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    most = int(count.max())
    log2phy = np.full((num_layers, num_logical * most), -1, np.int64)
    np.put_along_axis(
        log2phy,
        phy2log * most + rank,
        np.broadcast_to(np.arange(num_replicas), (num_layers, num_replicas)),
        axis=1,
    )
    return EplbPlan(phy2log, log2phy.reshape(num_layers, num_logical, most), count)

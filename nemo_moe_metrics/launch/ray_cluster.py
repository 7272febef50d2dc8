"""The Ray cluster the driver uses: an embedded local Ray or a running one, and where the ranks go.

- :func:`connect`: ``--ray-address`` / ``RAY_ADDRESS`` names a running cluster (started by
  ``ray start``, on Slurm by ``recipes/ray_slurm.py``'s script, or KubeRay); without one, an
  embedded local Ray is started with this machine's resources and stopped with the driver.
  An embedded Ray keeps its session files where Ray puts them by default (the system temp
  dir, ``/tmp/ray/session_*``) and authenticates with a token that lives only in the
  environment of the processes it starts, so nothing is written to the user's home.
- :func:`plan_placement`: one bundle per rank (1 CPU, or 1 GPU and 1 CPU where the cluster has
  GPUs), ``STRICT_SPREAD`` (one rank per node) when the cluster has several nodes and no more
  ranks than nodes, else ``PACK`` (a node's ranks together). A cluster that cannot hold the
  bundles is refused before any actor starts, naming what is missing.
- :func:`place`: the placement group, ready, with each rank's bundle and node.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.runtime.extras import require

#: Ray's own variable for a running cluster's address (``ray start`` prints it).
ADDRESS_ENV = "RAY_ADDRESS"


class RayClusterError(ConfigError):
    """The Ray cluster cannot run the recipe as asked (before any actor starts)."""


@dataclass
class RaySession:
    """This driver's connection to Ray: ``embedded`` when it started the cluster itself."""

    embedded: bool
    address: str

    def shutdown(self) -> None:
        """Disconnect; an embedded cluster's processes (GCS, raylet, workers) are stopped."""
        import ray

        if ray.is_initialized():
            ray.shutdown()


def import_ray(what: str = "nemo-moe-metrics run --engine ray") -> Any:
    """``ray``, or :class:`~nemo_moe_metrics.runtime.extras.MissingExtraError` naming the extra."""
    return require("ray", "launch", what)


def connect(address: str | None = None) -> RaySession:
    """Join the cluster at ``address`` (else ``RAY_ADDRESS``), or start an embedded local Ray."""
    ray = import_ray()
    address = address or os.environ.get(ADDRESS_ENV) or None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    if address:
        try:
            ctx = ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise RayClusterError(
                f"cannot connect to the Ray cluster at {address} ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else err}); start it first (ray start "
                f"--head on its first node), fix --ray-address / {ADDRESS_ENV}, or leave both "
                "unset for an embedded local Ray"
            ) from None
        return RaySession(embedded=False, address=str(ctx.address_info.get("gcs_address")))
    # Newer Ray protects a new local cluster with a token it would save in the home directory
    # when it finds none; one in the environment (inherited by the processes it starts) is
    # found first, and protects the cluster alike.
    has_token = {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(os.environ)
    saved = (Path.home() / ".ray" / "auth_token").is_file()
    if os.environ.get("RAY_AUTH_MODE") != "disabled" and not has_token and not saved:
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    ctx = ray.init(
        address="local",  # never join another cluster found on this machine
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        log_to_driver=True,
    )
    return RaySession(embedded=True, address=str(ctx.address_info.get("gcs_address")))


@dataclass
class PlacementPlan:
    """What the ranks ask of the cluster, checked against it."""

    world_size: int
    use_gpu: bool
    strategy: str
    nodes: list[dict[str, Any]] = field(default_factory=list)  # alive: id, ip, CPU, GPU

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's resources."""
        return {"CPU": 1.0, "GPU": 1.0} if self.use_gpu else {"CPU": 1.0}


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        nodes.append(
            {
                "node_id": node.get("NodeID"),
                "node_ip": node.get("NodeManagerAddress"),
                "CPU": float(res.get("CPU", 0)),
                "GPU": float(res.get("GPU", 0)),
            }
        )
    return nodes


def plan_placement(
    world_size: int, address: str, nodes: list[dict[str, Any]] | None = None
) -> PlacementPlan:
    """The bundles and strategy for ``world_size`` ranks; :class:`RayClusterError` naming what
    is missing when the cluster's nodes cannot hold them (``nodes``: for tests)."""
    nodes = _alive_nodes() if nodes is None else nodes
    use_gpu = any(n["GPU"] >= 1 for n in nodes)
    plan = PlacementPlan(world_size, use_gpu, "PACK", nodes)

    def capacity(n: dict[str, Any]) -> int:
        cap = math.floor(n["CPU"])
        return min(cap, math.floor(n["GPU"])) if use_gpu else cap

    able = [n for n in nodes if capacity(n) >= 1]
    if len(nodes) > 1 and world_size <= len(able):
        plan.strategy = "STRICT_SPREAD"  # one rank per node: each node's raylet runs one actor
    room = sum(capacity(n) for n in nodes)
    if room >= world_size:
        return plan
    unit = "1 GPU and 1 CPU" if use_gpu else "1 CPU"
    more = (
        f"add nodes to the cluster (ray start --address {address} on each)"
        if ":" in address
        else "start a Ray cluster with more nodes and pass its address (--ray-address)"
    )
    each = ", ".join(
        f"{n['node_ip']} {n['CPU']:g} CPU" + (f" {n['GPU']:g} GPU" if use_gpu else "")
        for n in nodes
    )
    raise RayClusterError(
        f"the Ray cluster at {address} cannot hold {world_size} ranks of {unit} each: its "
        f"{len(nodes)} node(s) ({each or 'none alive'}) hold {room}, {world_size - room} "
        f"missing. Lower --nproc to {room or 1} (the recipe's parallel sizes must still divide "
        f"it), or {more}"
    )


def embedded_nodes() -> list[dict[str, Any]]:
    """The one node an embedded local Ray would have: this machine's CPUs and GPUs."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    host = os.uname().nodename
    return [{"node_id": "local", "node_ip": host, "CPU": float(os.cpu_count() or 1), "GPU": gpus}]


def check_embedded(world_size: int) -> None:
    """Refuse, before Ray starts, ranks that an embedded local Ray on this machine could not
    hold (the same words as :func:`plan_placement`)."""
    plan_placement(world_size, "this machine (an embedded local Ray)", embedded_nodes())


@dataclass
class Placement:
    """A ready placement group: rank ``r`` runs in bundle ``bundles[r]`` on ``nodes[r]``."""

    group: Any
    plan: PlacementPlan
    bundles: list[int]
    nodes: list[str]

    def remove(self) -> None:
        """Give the bundles back to the cluster."""
        from ray.util.placement_group import remove_placement_group

        # Suppressed: the cluster may be going away, with nothing left to give back.
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)


def place(plan: PlacementPlan, timeout_s: float) -> Placement:
    """Create the placement group and wait (at most ``timeout_s``) until every bundle is held."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    group = placement_group([plan.bundle] * plan.world_size, strategy=plan.strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        Placement(group, plan, [], []).remove()
        raise RayClusterError(
            f"the Ray cluster did not grant {plan.world_size} x {plan.bundle} ({plan.strategy}) "
            f"within ray.start_timeout_s={timeout_s:g} s: its resources are held by other jobs "
            "(see `ray status`); free them or raise ray.start_timeout_s"
        )
    where = placement_group_table(group).get("bundles_to_node_id", {})
    node_of = {int(i): str(n) for i, n in where.items()}
    first_seen: dict[str, int] = {}
    for i in range(plan.world_size):
        first_seen.setdefault(node_of.get(i, ""), len(first_seen))
    # A node's ranks are consecutive (as torchrun numbers them): intra-node groups stay local.
    bundles = sorted(range(plan.world_size), key=lambda i: (first_seen[node_of.get(i, "")], i))
    return Placement(group, plan, bundles, [node_of.get(i, "") for i in bundles])


__all__ = [
    "ADDRESS_ENV",
    "Placement",
    "PlacementPlan",
    "RayClusterError",
    "RaySession",
    "check_embedded",
    "connect",
    "embedded_nodes",
    "import_ray",
    "place",
    "plan_placement",
]

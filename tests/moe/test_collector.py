"""The hook path makes no host-device synchronisation; compiled MoE blocks count each forward once.

``NoHostSync`` fails on every operation that makes the host wait for the device: at the
dispatcher level (``aten._local_scalar_dense`` behind ``.item()``/``int()``, ``nonzero``,
``is_nonzero``, ``equal``, copies from an accelerator to the CPU) and at the Python level
(``.tolist()``, ``.numpy()``, ``.item()``, ``.cpu()``, ``bool()``/``int()``/``float()`` of a
tensor), which CPU tensors would otherwise serve without dispatching.
"""

import contextlib

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_moe_metrics import attach_collector, register_router
from nemo_moe_metrics.families.router_health import enable_health

aten = torch.ops.aten
torch.set_num_threads(1)


class HostSyncError(AssertionError):
    """An operation that synchronises host and device ran under NoHostSync."""


_BANNED_OPS = {
    aten._local_scalar_dense,
    aten.item,
    aten.nonzero,
    aten.is_nonzero,
    aten.equal,
    aten.allclose,
}
_BANNED_METHODS = {
    "tolist",
    "numpy",
    "item",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
}


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _BANNED_OPS:
            raise HostSyncError(f"host sync: {func}")
        if func.overloadpacket in (aten._to_copy, aten.copy_):
            src = args[1] if func.overloadpacket is aten.copy_ else args[0]
            dst = args[0].device if func.overloadpacket is aten.copy_ else kwargs.get("device")
            if dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu":
                raise HostSyncError(f"device-to-host copy: {func}")
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _BANNED_METHODS:
            raise HostSyncError(f"host sync: Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    """Fail on any host-device synchronisation inside the block."""
    with _Function(), _Dispatch():
        yield


class Chunk(nn.Module):
    """A model chunk holding one router as ``layers.0`` (global layer 0)."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([router])

    def forward(self, x, **kwargs):
        return self.layers[0](x, **kwargs)


class CountOnlyExperts(nn.Module):
    """transformers' experts interface with a forward free of host syncs (the eager experts of
    transformers look up the hit experts on the host): what is left is our hook path."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states * top_k_weights.sum(-1, keepdim=True)


class MoEBlock(nn.Module):
    """A real transformers router (as ``gate``) feeding the experts, as the MoE blocks do."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.gate = router
        self.experts = CountOnlyExperts(router.num_experts)
        self.experts.config = router.config

    def forward(self, x):
        _, weights, index = self.gate(x)
        return self.experts(x, index, weights)


def _qwen3_router():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2)
    router = Qwen3MoeTopKRouter(config)
    router.config = config
    nn.init.normal_(router.weight)
    return router


def _deepseek_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1
    )
    router = DeepseekV3TopkRouter(cfg)
    router.config = cfg
    nn.init.normal_(router.weight)
    return router


@pytest.mark.parametrize("build", [_qwen3_router, _deepseek_router])
def test_hf_router_hook_path_makes_no_host_sync(build):
    router = build()
    chunk = Chunk(MoEBlock(router))
    collector = attach_collector(chunk)
    x = torch.randn(10, 16)
    with no_host_sync():
        for _ in range(3):
            chunk(x)
    expected = np.bincount(router(x)[2].reshape(-1).numpy(), minlength=8) * 3
    np.testing.assert_array_equal(collector.export().counts[0], expected)


@pytest.mark.parametrize("build", [_qwen3_router, _deepseek_router])
def test_router_health_hook_path_makes_no_host_sync(build):
    router = build()
    chunk = Chunk(MoEBlock(router))
    collector = attach_collector(chunk)
    tracker = enable_health(collector, near_tie_gap=0.01)
    x = torch.randn(10, 16)
    with no_host_sync():
        for _ in range(3):
            chunk(x)
    sums, _ = tracker.local_stats()
    assert sums[0, 0].item() == 30  # every token of the three forwards was judged


@pytest.mark.parametrize(
    "family",
    # the ways transformers families keep what health reads: a bias passed as an argument
    # (afmoe), groups filled with 0 (axk2), a bias on the logits (kolibri1), a bias nested in a
    # submodule (ernie4_5_moe), zero-computation classes (longcat_flash), a score_fn module
    # (deepseek_v4's last layer), product keys (doge)
    ["afmoe", "axk2", "kolibri1", "ernie4_5_moe", "longcat_flash", "deepseek_v4", "doge"],
)
def test_router_health_of_transformers_families_makes_no_host_sync(family):
    from hf_families import tiny_model

    model = tiny_model(family)
    block = model.model.layers[-1].mlp
    text = model.config.get_text_config()
    if hasattr(block, "experts"):  # transformers' eager experts look up hit experts on the host
        block.experts = CountOnlyExperts(block.experts.num_experts)
        block.experts.config = text
    chunk = Chunk(block)
    collector = attach_collector(chunk)
    tracker = enable_health(collector, near_tie_gap=0.01)
    assert tracker.scoring(0) is not None, family
    x = torch.randn(1, 10, text.hidden_size)
    with no_host_sync():
        for _ in range(2):
            chunk(x)
    sums, _ = tracker.local_stats()
    assert sums[0, 0].item() == 20  # every token of the two forwards was judged


class ThresholdRouter(nn.Module):
    """A custom router: expert e takes token t when score > 0 (a boolean [T, E] map)."""

    def __init__(self, experts=4):
        super().__init__()
        self.proj = nn.Linear(6, experts)

    def forward(self, x):
        return self.proj(x) > 0


def test_registered_router_counts_boolean_map_without_sync():
    register_router(
        ThresholdRouter,
        lambda m, args, kwargs, out: (out, out.shape[0]),
        num_experts=lambda m: m.proj.out_features,
        topk=lambda m: 1,
    )
    torch.manual_seed(1)
    chunk = Chunk(ThresholdRouter())
    collector = attach_collector(chunk)
    x = torch.randn(7, 6)
    with no_host_sync():
        chunk(x)
    loads = collector.export()
    np.testing.assert_array_equal(loads.counts[0], (chunk.layers[0](x)).sum(0).numpy())
    assert loads.routed_tokens.tolist() == [7]


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: bool(t.any()),
        lambda t: t.nonzero(),
        lambda t: int(t.sum()),
    ],
    ids=["item", "tolist", "bool", "nonzero", "int"],
)
def test_no_host_sync_mode_catches_syncs(bad):
    t = torch.ones(4, dtype=torch.bool)
    with pytest.raises(HostSyncError), no_host_sync():
        bad(t)


def test_compiled_moe_block_fullgraph_counts_each_forward_once():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2
    )
    cfg._experts_implementation = "batched_mm"  # the eager loop branches on nonzero()
    torch.manual_seed(0)
    chunk = Chunk(Qwen3MoeSparseMoeBlock(cfg))
    for p in chunk.parameters():
        nn.init.normal_(p, std=0.1)
    collector = attach_collector(chunk)
    compiled = torch.compile(chunk, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 32)
    for _ in range(3):
        compiled(x).sum().backward()
    with torch.no_grad():
        compiled(x)
    loads = collector.export()
    with torch.no_grad():
        reference = chunk.layers[0].gate(x.view(-1, 32))[2].reshape(-1).numpy()
    np.testing.assert_array_equal(loads.counts[0], np.bincount(reference, minlength=8) * 3)
    assert loads.routed_tokens.tolist() == [3 * 10]


class _CountSyncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _BANNED_METHODS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_steady_state_export_reads_the_device_once():
    chunk = Chunk(MoEBlock(_qwen3_router()))
    collector = attach_collector(chunk)
    collector.export()  # the first export agrees on the layout
    chunk(torch.randn(4, 16))
    counter = _CountSyncs()
    with counter, _Dispatch():
        loads = collector.export()
    # One read of the packed host buffer (a device tensor is first copied with non_blocking=True).
    assert counter.calls == ["numpy"]
    assert loads.counts.sum() == 4 * 2

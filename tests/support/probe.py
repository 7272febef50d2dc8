"""A metrics-hooks probe for the policy worker's hook protocol, and tensor<->numpy transport
for results coming back from spawned ranks."""

from __future__ import annotations

import contextlib

import torch


class ProbeHooks:
    """Records every hook call and every router forward (grad mode, train mode, padding)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.router_calls: list[dict] = []
        self.in_step = False

    def attach(self, model, transformer_config) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.moe.router import TopKRouter

        self.calls.append(
            (
                "attach",
                isinstance(model, GPTModel),
                transformer_config is model.config,
                transformer_config.num_moe_experts,
            )
        )
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_pre_hook(self._router, with_kwargs=True)

    def _router(self, module, args, kwargs):
        hidden = args[0]
        mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        self.router_calls.append(
            {
                "grad": torch.is_grad_enabled(),
                "training": module.training,
                "tokens": hidden.shape[0] * hidden.shape[1],
                "valid": None if mask is None else int((~mask).sum()),
            }
        )

    @contextlib.contextmanager
    def step(self):
        self.calls.append(("step_enter",))
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False
            self.calls.append(("step_exit",))

    def microbatch(self, *, seq_lens):
        self.calls.append(
            (
                "microbatch",
                seq_lens.tolist(),
                self.in_step,
                torch.is_grad_enabled(),
                str(seq_lens.dtype),
            )
        )

    def finish_step(self, *, num_microbatches):
        self.calls.append(("finish_step", num_microbatches, self.in_step))
        return {"moe/probe": 1.5, "train_perf/probe": 2.5}


def portable(obj):
    """Tensors -> numpy (pickled by value: torch's shared-memory handles die with the rank)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def to_torch(obj):
    """The inverse of portable."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_torch(v) for v in obj)
    return obj

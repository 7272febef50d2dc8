"""The TRL tests' tiny MoE: the example's builders (examples/integrate_trl.py), and an oracle.

Everything is built from a config and a vocabulary list: nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "integrate_trl.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("integrate_trl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()
tiny_tokenizer = example.tiny_tokenizer
save_tiny_model = example.save_tiny_model
load_tiny_model = example.load_tiny_model
build_trainer = example.build_trainer


class ExpertsOracle:
    """An independent count of what the experts execute, per layer, on real tokens only.

    A forward pre-hook on the model keeps the real-token mask of the current forward (its
    ``attention_mask``, the positions of this forward: the last ``width`` columns, so decode
    steps read their own token); a forward pre-hook on each layer's ``mlp.experts`` adds the
    ``top_k_index`` rows of real tokens to the layer's counts. Training forwards (train mode,
    grad on, not inside backward) go to ``train``; forwards inside ``model.generate`` to
    ``rollout``, up to and including each sequence's first end-of-sequence token of its
    completion, judged after ``generate`` returned, from the sequences it returned
    (``rollout_all``: every masked position, those after the end too); everything else is
    ignored.
    """

    def __init__(self, model: nn.Module, num_experts: int) -> None:
        self.num_experts = num_experts
        self.train: dict[int, torch.Tensor] = {}
        self.rollout: dict[int, torch.Tensor] = {}
        self.rollout_all: dict[int, torch.Tensor] = {}
        self._forwards: list[tuple[int, int, torch.Tensor]] = []  # generate's: total, width, mask
        self._picks: list[tuple[int, int, torch.Tensor]] = []  # layer, forward, top_k_index
        self.train_steps: list[int] = []  # real tokens of training forwards, per optimizer step
        self._mask: torch.Tensor | None = None
        self._phase: str | None = None
        self._generating = False
        self._handles = [model.register_forward_pre_hook(self._model_pre, with_kwargs=True)]
        for i, layer in enumerate(model.model.layers):
            self._handles.append(
                layer.mlp.experts.register_forward_pre_hook(self._experts_pre(i), with_kwargs=True)
            )
        generate = model.generate

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._generating = True
            self._forwards, self._picks = [], []
            try:
                sequences = generate(*args, **kwargs)
            finally:
                self._generating = False
            eos = (kwargs.get("generation_config") or model.generation_config).eos_token_id
            self._count_rollout(sequences, [eos] if isinstance(eos, int) else list(eos))
            return sequences

        model.generate = wrapped

    def _model_pre(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        width = int(ids.shape[1])
        mask = kwargs.get("attention_mask")
        real = torch.ones(ids.shape[:2], dtype=torch.bool) if mask is None else mask[:, -width:]
        self._mask = real.reshape(-1).bool()
        in_backward = torch._C._current_graph_task_id() != -1
        if self._generating:
            self._phase = "rollout"
            total = int(mask.shape[1]) if mask is not None else width
            self._forwards.append((total, width, real.bool()))
        elif model.training and torch.is_grad_enabled() and not in_backward:
            self._phase = "train"
        else:
            self._phase = None

    def _experts_pre(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._phase is None or torch._C._current_graph_task_id() != -1:
                return  # not counted, or a checkpointed layer replayed in backward
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            if self._phase == "rollout":  # judged once generate returns its sequences
                self._picks.append((layer, len(self._forwards) - 1, index.detach().clone()))
                return
            real = index[self._mask]
            counts = torch.bincount(real.reshape(-1), minlength=self.num_experts)
            table = self.train if self._phase == "train" else self.rollout
            table[layer] = table.get(layer, torch.zeros_like(counts)) + counts

        return hook

    def _count_rollout(self, sequences: torch.Tensor, eos: list[int]) -> None:
        prompt = self._forwards[0][0]  # the prefill's width: the prompt, padding included
        completion = sequences[:, prompt:]
        ended = torch.isin(completion, torch.tensor(eos))
        end = torch.where(ended.any(-1), ended.int().argmax(-1), completion.shape[1])
        last_real = prompt + end  # the absolute position of each sequence's end token
        for layer, forward, index in self._picks:
            total, width, mask = self._forwards[forward]
            position = torch.arange(total - width, total)
            kept = mask & (position.unsqueeze(0) <= last_real.unsqueeze(1))
            for table, keep in ((self.rollout, kept), (self.rollout_all, mask)):
                rows = index.reshape(-1, index.shape[-1])[keep.reshape(-1)]
                counts = torch.bincount(rows.reshape(-1), minlength=self.num_experts)
                table[layer] = table.get(layer, torch.zeros_like(counts)) + counts

    def tokens(self, phase: str = "train") -> int:
        """Real tokens routed (layer 0's assignments / top-k)."""
        table = self.train if phase == "train" else self.rollout
        return int(table[0].sum()) // 2 if table else 0

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()


def logged_counts(metrics: dict[str, Any], num_layers: int, num_experts: int) -> dict[int, list]:
    """Per-layer expert counts from a logged ``moe/expert_loads`` table."""
    out = {layer: [0] * num_experts for layer in range(num_layers)}
    for layer, expert, tokens, _ in metrics["moe/expert_loads"]:
        out[int(layer)][int(expert)] = int(tokens)
    return out

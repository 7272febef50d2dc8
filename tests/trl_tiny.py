"""A tiny random Qwen3-MoE, a word-level tokenizer and small datasets for the TRL tests (no hub).

Everything is built here from a config and a vocabulary list: nothing is downloaded. DPO and GRPO
rebuild the reference model from ``config._name_or_path``, so the model is saved to a folder
and loaded back with ``from_pretrained``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

WORDS = [f"w{i}" for i in range(120)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def tiny_tokenizer() -> Any:
    """A word-level fast tokenizer over :data:`WORDS` (pad id 0, eos id 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.padding_side = "right"
    return tok


def tiny_config(**overrides: Any) -> Any:
    """2 decoder layers, 4 experts, top-2: a qwen3_moe small enough for a CPU step in ~50 ms."""
    from transformers import Qwen3MoeConfig

    fields = dict(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, intermediate_size=32,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, attn_implementation="eager", router_aux_loss_coef=0.01,
        pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    fields.update(overrides)
    config = Qwen3MoeConfig(**fields)
    config._experts_implementation = "eager"
    return config


def save_tiny_model(folder: Path, **overrides: Any) -> Path:
    """Save a random tiny model and its tokenizer to ``folder`` (seeded: the same every time)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides))
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def load_tiny_model(folder: Path) -> nn.Module:
    """The saved tiny model, eager experts and attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    model.config._experts_implementation = "eager"
    return model


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def sft_dataset(n: int = 16, seed: int = 0) -> Any:
    """Texts of 3 to 14 words (uneven: batches are padded)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"text": _sentence(rng, 3, 14)} for _ in range(n)])


def dpo_dataset(n: int = 16, seed: int = 0) -> Any:
    """Prompt, chosen and rejected texts of uneven lengths."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [
        {
            "prompt": _sentence(rng, 2, 6),
            "chosen": _sentence(rng, 1, 6),
            "rejected": _sentence(rng, 1, 6),
        }
        for _ in range(n)
    ]
    return Dataset.from_list(rows)


def grpo_dataset(n: int = 8, seed: int = 0) -> Any:
    """Prompts of 2 to 7 words (left-padded by GRPO)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": _sentence(rng, 2, 7)} for _ in range(n)])


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward for GRPO: shorter completions score higher."""
    return [-float(len(c.split())) for c in completions]


def common_args() -> dict[str, Any]:
    """TrainingArguments every TRL test shares: CPU, fp32, no checkpoints, quiet."""
    return dict(
        use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, seed=0,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
        learning_rate=1e-3, report_to=[], dataloader_num_workers=0,
    )  # fmt: skip


class ExpertsOracle:
    """An independent count of what the experts execute, per layer, on real tokens only.

    A forward pre-hook on the model keeps the real-token mask of the current forward (its
    ``attention_mask``, the positions of this forward: the last ``width`` columns, so decode
    steps read their own token); a forward pre-hook on each layer's ``mlp.experts`` adds the
    ``top_k_index`` rows of real tokens to the layer's counts. Training forwards (train mode,
    grad on, not inside backward) go to ``train``; forwards inside ``model.generate`` to
    ``rollout``; everything else is ignored.
    """

    def __init__(self, model: nn.Module, num_experts: int) -> None:
        self.num_experts = num_experts
        self.train: dict[int, torch.Tensor] = {}
        self.rollout: dict[int, torch.Tensor] = {}
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
            try:
                return generate(*args, **kwargs)
            finally:
                self._generating = False

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
        elif model.training and torch.is_grad_enabled() and not in_backward:
            self._phase = "train"
        else:
            self._phase = None

    def _experts_pre(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._phase is None or torch._C._current_graph_task_id() != -1:
                return  # not counted, or a checkpointed layer replayed in backward
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            real = index[self._mask]
            counts = torch.bincount(real.reshape(-1), minlength=self.num_experts)
            table = self.train if self._phase == "train" else self.rollout
            table[layer] = table.get(layer, torch.zeros_like(counts)) + counts

        return hook

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

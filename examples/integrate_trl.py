"""TRL's SFT, DPO or GRPO trainer on a tiny random MoE, with MoEMetricsCallback (CPU is enough).

Run it (one process, or two under torchrun; nothing is downloaded)::

    python examples/integrate_trl.py --trainer grpo --out /tmp/trl_run
    torchrun --nproc-per-node 2 examples/integrate_trl.py --trainer sft --out /tmp/trl_run
    nemo-moe-metrics report /tmp/trl_run

The model is a 2-layer Qwen3-MoE (4 experts, top-2) built from a config, the tokenizer a
word-level one over 120 made-up words, the data random sentences of uneven length (so batches
are padded). The metric lines are marked ``# (metrics)``: the callback in ``callbacks=[...]``;
everything else is an ordinary TRL script. ``--out`` receives the run directory
(``metrics.jsonl``, ``expert_loads.bin``, ``run.json``), the Trainer's own output
(``trainer/``, TensorBoard under ``trainer/runs``) and the saved tiny model (``model/``).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nemo_moe_metrics.config import LoggerConfig, MetricsConfig

WORDS = [f"w{i}" for i in range(120)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def tiny_tokenizer() -> Any:
    """A word-level fast tokenizer over :data:`WORDS` (pad id 0, eos id 1), right padding."""
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
    """2 decoder layers, 4 experts, top-2: a qwen3_moe whose CPU step takes tens of ms."""
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
    config._experts_implementation = "eager"  # the per-expert loop (grouped_mm is GPU-oriented)
    return config


def save_tiny_model(folder: Path, **overrides: Any) -> Path:
    """Save a random tiny model (seed 0: the same weights every time) and its tokenizer.

    DPO and GRPO rebuild a reference model from ``config._name_or_path``: a saved folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides))
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def load_tiny_model(folder: Path) -> nn.Module:
    """The saved tiny model with eager experts and attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    model.config._experts_implementation = "eager"
    return model


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def sft_dataset(n: int = 16, seed: int = 0) -> Any:
    """Texts of 3 to 14 words (uneven lengths: batches are padded)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"text": _sentence(rng, 3, 14)} for _ in range(n)])


def dpo_dataset(n: int = 16, seed: int = 0) -> Any:
    """Prompt, chosen and rejected texts of uneven lengths."""
    from datasets import Dataset

    rng = random.Random(seed)
    keys = (("prompt", 2, 6), ("chosen", 1, 6), ("rejected", 1, 6))
    return Dataset.from_list(
        [{key: _sentence(rng, lo, hi) for key, lo, hi in keys} for _ in range(n)]
    )


def grpo_dataset(n: int = 8, seed: int = 0) -> Any:
    """Prompts of 2 to 7 words (GRPO pads them on the left)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": _sentence(rng, 2, 7)} for _ in range(n)])


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """GRPO's reward: shorter completions score higher."""
    return [-float(len(c.split())) for c in completions]


def common_args() -> dict[str, Any]:
    """TrainingArguments every trainer here shares: CPU, fp32, no checkpoints, quiet."""
    return dict(
        use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, seed=0,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
        learning_rate=1e-3, report_to=[], dataloader_num_workers=0,
    )  # fmt: skip


def build_trainer(
    kind: str, model_dir: Path, output_dir: Path, callbacks: list, **overrides: Any
) -> Any:
    """One of ``trainer`` (plain transformers), ``sft``, ``dpo``, ``grpo`` on the tiny model."""
    args = {**common_args(), "output_dir": str(output_dir), **overrides}
    model = load_tiny_model(model_dir)
    tok = tiny_tokenizer()
    if kind == "trainer":
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        data = sft_dataset().map(lambda row: tok(row["text"]), remove_columns=["text"])
        return Trainer(
            model=model,
            args=TrainingArguments(**args),
            train_dataset=data,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=callbacks,
        )
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        return SFTTrainer(
            model=model,
            args=SFTConfig(**args),
            train_dataset=sft_dataset(),
            processing_class=tok,
            callbacks=callbacks,
        )
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer(
            model=model,
            args=DPOConfig(**args),
            train_dataset=dpo_dataset(),
            processing_class=tok,
            callbacks=callbacks,
        )
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        grpo = {"num_generations": 2, "max_completion_length": 6, **args}
        return GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=GRPOConfig(**grpo),
            train_dataset=grpo_dataset(),
            processing_class=tok,
            callbacks=callbacks,
        )
    raise ValueError(f"unknown trainer {kind!r}; choose trainer, sft, dpo or grpo")


def run(kind: str, out: Path, *, steps: int = 4) -> Any:
    """Train ``steps`` optimizer steps; returns the callback (``callback.last_metrics``)."""
    from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback

    rank = int(os.environ.get("RANK", 0))
    model_dir = save_tiny_model(out / "model" / f"rank{rank}")  # same seed: same weights
    callback = MoEMetricsCallback(  # (metrics) every flag on; the table every step
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=True,
            track_throughput=True,
            track_flops=True,
        ),
        run_dir=out,  # (metrics) what `nemo-moe-metrics report` reads, written by rank 0
        logger=LoggerConfig(table_every=1),  # (metrics) JSONL + store: report_to has the rest
    )
    trainer = build_trainer(  # (metrics) the callback, added the ordinary way
        kind, model_dir, out / "trainer", [callback], max_steps=steps, report_to=["tensorboard"]
    )
    trainer.train()
    return callback


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--trainer``, ``--out``, ``--steps``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=["trainer", "sft", "dpo", "grpo"], default="grpo")
    parser.add_argument("--out", type=Path, required=True, help="run directory")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    from nemo_moe_metrics.runtime.extras import missing_extra_message, missing_modules

    missing = missing_modules("trl")
    if missing:
        raise SystemExit(f"error: {missing_extra_message(missing[0], 'trl', 'this example')}")
    callback = run(args.trainer, args.out, steps=args.steps)
    if int(os.environ.get("RANK", 0)) == 0:
        last = callback.last_metrics
        print(
            f"{args.trainer}: moe/max_over_ideal {last['moe/max_over_ideal']:.3f}, "
            f"moe/routed_tokens {last['moe/routed_tokens']:.0f}, "
            f"train_perf/tokens {last['train_perf/tokens']:.0f}; "
            f"read it with: nemo-moe-metrics report {args.out}"
        )


if __name__ == "__main__":
    main()

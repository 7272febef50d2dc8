"""A reference Megatron policy worker: the tiny recipe model, trained the way NeMo RL trains it.

One optimizer step = megatron-core's own ``get_forward_backward_func()`` schedule over the
step's microbatches, then an explicit data-parallel gradient all-reduce (dense parameters over
the data-parallel group, expert parameters over the expert-data-parallel group, as
megatron-core's DDP does), then AdamW. Reference scoring and sampling run under
``torch.no_grad()`` with the model in eval mode, so routers record no aux loss and a metrics
hook can tell those forwards apart from training.

The metrics layer plugs in through ``metrics`` (a ``PolicyMetrics``, or any object with its
methods: see :class:`MegatronPolicyWorker`); with ``metrics=None`` nothing extra runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nemo_moe_metrics.algorithms.data import PAD_ID, SequenceBatch
from nemo_moe_metrics.config import Recipe
from nemo_moe_metrics.export import metric_names as names
from nemo_moe_metrics.megatron import compat
from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode, cuda_available
from nemo_moe_metrics.megatron.model import build_model, causal_attention_mask, init_distributed

#: ``SequenceBatch.extras`` key of the rollout's routes ``[b, s, moe_layers, top_k]``
#: (``-1``: none).
ROLLOUT_ROUTES = "rollout_routes"

# loss_fn(token_logprobs [b, s-1], microbatch) -> (loss of this microbatch, {full key: value}).
# The loss is a mean over the microbatch's sequences: the schedule divides each microbatch's
# loss by the number of microbatches, so equal-size microbatches give the batch mean exactly.
LossFn = Callable[[torch.Tensor, SequenceBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s-1]`` log-probability of token ``t+1`` given the prefix up to ``t``."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


class MegatronPolicyWorker:
    """Trains, scores and samples the recipe's megatron-core model (GPT or hybrid) on this rank.

    ``metrics`` is an optional, duck-typed metrics object (``PolicyMetrics``) with this protocol
    (``hooks=`` is its old name, still accepted):

    - ``attach(model, transformer_config)``: once, right after the model is built.
    - ``step()``: a context manager entered around each optimizer step (forward-backward of all
      microbatches, gradient all-reduce, optimizer update).
    - ``microbatch(seq_lens=...)``: once per training microbatch, inside megatron-core's
      ``forward_step_func`` before the model forward; ``seq_lens`` is an int64 tensor ``[b]`` of
      real (non-padding) token counts, on the model's device, never read on the host here.
    - ``finish_step(num_microbatches=...) -> dict``: after the optimizer step; the dict is merged
      into :meth:`train`'s result with its keys unchanged (``moe/...``, ``train_perf/...``).

    Forwards from :meth:`logprobs` and :meth:`generate` (DPO reference, GRPO rollouts) run with
    grad disabled and ``model.training`` False; no hook method is called for them.
    """

    def __init__(
        self, recipe: Recipe, *, metrics: Any | None = None, hooks: Any | None = None
    ) -> None:
        """Join the process group, build the model and AdamW, then attach ``metrics``."""
        if hooks is not None and metrics is not None:
            raise TypeError("MegatronPolicyWorker: pass metrics=... (hooks= is its old name)")
        metrics = metrics if metrics is not None else hooks
        mcfg = recipe.policy.megatron_cfg
        if mcfg.pipeline_model_parallel_size != 1 or mcfg.context_parallel_size != 1:
            raise ValueError(
                "the reference worker scores and samples with plain forwards, which need the "
                "whole model on each rank: set policy.megatron_cfg.pipeline_model_parallel_size=1 "
                "and context_parallel_size=1 (expert parallelism is supported)"
            )
        from megatron.core import parallel_state

        self.recipe = recipe
        self.micro_batch_size = recipe.policy.train_micro_batch_size
        init_distributed(mcfg, seed=recipe.training.seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if cuda_available()
            else (torch.device("cpu"))
        )
        self.model = build_model(recipe.policy.model, mcfg)
        self.transformer_config = self.model.config
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=recipe.training.learning_rate, weight_decay=0.0
        )
        self.dp_group = parallel_state.get_data_parallel_group()
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.metrics = metrics
        self.router_replay = mcfg.moe_enable_routing_replay
        self._reference_state: dict[str, Any] | None = None
        if metrics is not None:
            metrics.attach(self.model, self.transformer_config)

    # ------------------------------------------------------------------ training
    def train(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, Any]:
        """One optimizer step over ``batch`` cut into ``train_micro_batch_size`` microbatches.

        Returns ``train/loss`` and the loss function's metrics (each averaged over microbatches
        and data-parallel ranks), ``train/num_microbatches`` (this rank's) and
        ``train/num_sequences`` (the step's global batch: summed over the data-parallel ranks),
        plus ``metrics.finish_step(...)``'s dict unchanged.
        """
        from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n, mbs = len(batch), self.micro_batch_size
        if n == 0 or n % mbs:
            raise ValueError(
                f"a training batch of {n} sequences cannot be cut into microbatches of "
                f"train_micro_batch_size={mbs}; pass a positive multiple of {mbs}"
            )
        num_microbatches = n // mbs
        batch = self._to_device(batch)
        microbatches = [batch.slice(i * mbs, (i + 1) * mbs) for i in range(num_microbatches)]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        step = self.metrics.step() if self.metrics is not None else contextlib.nullcontext()
        with step, self._replay_scope():
            with cpu_device_mode():
                outputs = get_forward_backward_func()(
                    forward_step_func=partial(self._forward_step, loss_fn),
                    data_iterator=iter(microbatches),
                    model=self.model,
                    num_microbatches=num_microbatches,
                    seq_length=batch.tokens.shape[1],
                    micro_batch_size=mbs,
                    forward_only=False,
                )
            self._allreduce_grads()
            self.optimizer.step()
            # What megatron-core's finalize_model_grads does at the end of a global batch besides
            # the gradient sync: reset the routers' per-batch state (global aux-loss counts).
            reset_model_temporary_tensors(self.transformer_config, [self.model])
        hook_metrics = (
            self.metrics.finish_step(num_microbatches=num_microbatches)
            if self.metrics is not None
            else {}
        )
        result: dict[str, Any] = self._reduce_own_metrics(outputs, sequences=n)
        result[names.TRAIN_NUM_MICROBATCHES] = num_microbatches
        clash = sorted(set(result) & set(hook_metrics))
        if clash:
            raise ValueError(f"the metrics returned keys the worker already owns: {clash}")
        result.update(hook_metrics)
        return result

    def _forward_step(
        self, loss_fn: LossFn, data_iterator: Iterator[SequenceBatch], model: torch.nn.Module
    ):
        # megatron-core calls this once per microbatch and passes the returned output tensor
        # to the returned loss function.
        mb = next(data_iterator)
        routes = mb.extras.get(ROLLOUT_ROUTES)
        if self.metrics is not None:
            if routes is None:
                self.metrics.microbatch(seq_lens=mb.lengths)
            else:
                self.metrics.microbatch(seq_lens=mb.lengths, rollout_routes=routes)
        if self.router_replay:
            self._set_replay(routes)
        logits = self._forward(model, mb.tokens, mb.padding_mask())
        return token_logprobs(logits, mb.tokens), partial(self._loss, loss_fn, mb)

    @staticmethod
    def _loss(loss_fn: LossFn, mb: SequenceBatch, logprobs: torch.Tensor):
        loss, metrics = loss_fn(logprobs, mb)
        # clone: the schedule divides the returned loss by num_microbatches in place.
        reported = {names.TRAIN_LOSS: loss.detach().clone()}
        reported.update({k: torch.as_tensor(v).detach().clone() for k, v in metrics.items()})
        return loss, reported

    def _forward(
        self, model: torch.nn.Module, tokens: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, s = tokens.shape
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        # padding_mask: True at padding (megatron-core inverts it to find valid tokens), so the
        # routers' aux losses ignore padding. The causal mask is explicit because megatron-core
        # builds its default one on "cuda".
        return model(
            tokens,
            position_ids,
            causal_attention_mask(s, device=tokens.device),
            padding_mask=padding_mask,
        )

    @contextlib.contextmanager
    def _replay_scope(self) -> Iterator[None]:
        # Router replay (R3) covers exactly the training forwards of one step.
        try:
            yield
        finally:
            if self.router_replay:
                compat.clear_router_replay(compat.megatron_routers(self.model))

    def _set_replay(self, routes: torch.Tensor | None) -> None:
        routers = compat.megatron_routers(self.model)
        if routes is None:
            raise ValueError(
                "moe_enable_routing_replay is on but the training batch carries no "
                f"extras[{ROLLOUT_ROUTES!r}]: router replay needs the rollout's routes"
            )
        # [b, s, L, k] -> the routers' token order [s * b] per MoE layer; -1 rows (padding,
        # tokens without a route) fall back on the live router (compat.capture_router_choice).
        b, s, layers, k = routes.shape
        if layers != len(routers):
            raise ValueError(f"rollout routes have {layers} MoE layers, the model {len(routers)}")
        flat = routes.transpose(0, 1).reshape(s * b, layers, k)
        compat.set_router_replay(routers, [flat[:, j] for j in range(layers)])

    def rollout_routes(self, batch: SequenceBatch, precision: str = "fp32") -> torch.Tensor:
        """The experts each real token was routed to in a rollout forward, ``[b, s, L, k]``.

        What an inference engine returns with its routes (vLLM's ``routed_experts``): recorded
        by forward hooks on every router during one eval, no-grad forward in ``precision``
        (``"bf16"``: CPU/CUDA autocast). Padding positions hold ``-1``; MoE layers in model order.
        """
        routers = compat.megatron_routers(self.model)
        if not routers:
            raise ValueError("rollout_routes needs a model with MoE routers")
        batch = self._to_device(batch)
        maps: dict[int, list[torch.Tensor]] = {}

        def record(module, args, output):
            maps.setdefault(int(module.layer_number), []).append(output[1])

        handles = [r.register_forward_hook(record) for r in routers]
        parts = []
        try:
            with self._inference(), self._precision(precision):
                for start in range(0, len(batch), self.micro_batch_size):
                    mb = batch.slice(start, start + self.micro_batch_size)
                    maps.clear()
                    self._forward(self.model, mb.tokens, mb.padding_mask())
                    b, s = mb.tokens.shape
                    k = int(routers[0].topk)
                    per_layer = [
                        maps[int(r.layer_number)][0]
                        .to(torch.float32)
                        .topk(k, dim=1)
                        .indices.reshape(s, b, k)
                        .transpose(0, 1)
                        for r in routers
                    ]
                    routes = torch.stack(per_layer, dim=2)
                    routes[mb.padding_mask()] = -1
                    parts.append(routes)
        finally:
            for h in handles:
                h.remove()
        return torch.cat(parts)

    @contextlib.contextmanager
    def _precision(self, precision: str) -> Iterator[None]:
        if precision == "fp32":
            yield
            return
        if precision != "bf16":
            raise ValueError(f"rollout precision must be fp32 or bf16, got {precision!r}")
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            yield

    def _allreduce_grads(self) -> None:
        # Megatron DDP semantics: every gradient is scaled by 1/dp_size, then dense gradients are
        # summed over the data-parallel group and expert gradients (param.allreduce False) over
        # the expert-data-parallel group (expert ranks already saw all tokens of their group).
        dense, expert = [], []
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                # Every rank of a group must contribute the same tensors in the same order.
                p.grad = torch.zeros_like(p)
            (dense if getattr(p, "allreduce", True) else expert).append(p.grad)
        for grads, group in ((dense, self.dp_group), (expert, self.expert_dp_group)):
            if not grads:
                continue
            flat = _flatten_dense_tensors(grads)
            flat.mul_(1.0 / self.dp_size)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(synced)

    def _reduce_own_metrics(
        self, outputs: list[dict[str, torch.Tensor]], *, sequences: int
    ) -> dict[str, Any]:
        # Mean over microbatches, then one all-reduce over data-parallel ranks: the logged loss
        # is the global batch's, not rank 0's alone. The same all-reduce sums the sequences:
        # train/num_sequences is the global batch (all data-parallel ranks, as in NeMo RL).
        keys = sorted(outputs[0])
        local = torch.stack(
            [torch.stack([o[k].float().reshape(()) for o in outputs]).mean() for k in keys]
            + [torch.full((), float(sequences), device=self.device)]
        )
        if self.dp_size > 1:
            dist.all_reduce(local, group=self.dp_group)
            local[:-1] /= self.dp_size
        values = local.tolist()
        out: dict[str, Any] = dict(zip(keys, values[:-1], strict=True))
        out[names.TRAIN_NUM_SEQUENCES] = round(values[-1])
        return out

    def _to_device(self, batch: SequenceBatch) -> SequenceBatch:
        if batch.tokens.device == self.device:
            return batch
        return SequenceBatch(
            batch.tokens.to(self.device, non_blocking=True),
            batch.lengths.to(self.device, non_blocking=True),
            batch.prompt_lengths.to(self.device, non_blocking=True),
            {k: v.to(self.device, non_blocking=True) for k, v in batch.extras.items()},
        )

    # ------------------------------------------------------------- inference
    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """``[b, s-1]`` log-probs of each next token, without grad, in eval mode, microbatched.

        Every rank of an expert-parallel group must call this with the same batch shape (the
        token dispatcher exchanges activations).
        """
        batch = self._to_device(batch)
        out = []
        # With router replay, the old log-probs are scored on the rollout's experts too (as
        # NeMo RL's R3 does for prev-logprobs), so the importance ratio starts at 1.
        replay = self.router_replay and ROLLOUT_ROUTES in batch.extras
        with self._inference(), self._replay_scope():
            for start in range(0, len(batch), self.micro_batch_size):
                mb = batch.slice(start, start + self.micro_batch_size)
                if replay:
                    self._set_replay(mb.extras[ROLLOUT_ROUTES])
                logits = self._forward(self.model, mb.tokens, mb.padding_mask())
                out.append(token_logprobs(logits, mb.tokens))
        return torch.cat(out)

    def generate(
        self,
        prompts: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        precision: str = "fp32",
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` after equal-length ``prompts`` ``[n, p]``; returns
        ``[n, p+new]``.

        No KV cache (the model is tiny): each new token re-runs the whole prefix. Padding is
        never sampled. Sampling uses ``generator`` (CPU) for reproducibility; ``precision``
        ``"bf16"`` runs the forwards under autocast, as an inference engine would.
        """
        if prompts.dim() != 2 or prompts.shape[1] == 0:
            raise ValueError(
                f"prompts must be a non-empty [n, p] tensor, got {tuple(prompts.shape)}"
            )
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        limit = self.recipe.policy.model.seq_length
        if prompts.shape[1] + max_new_tokens > limit:
            raise ValueError(
                f"prompt length {prompts.shape[1]} + max_new_tokens {max_new_tokens} exceeds "
                f"seq_length={limit}; shorten the prompt/response or raise policy.model.seq_length"
            )
        seqs = prompts.to(self.device)
        with self._inference(), self._precision(precision):
            for _ in range(max_new_tokens):
                rows = []
                for start in range(0, seqs.shape[0], self.micro_batch_size):
                    mb = seqs[start : start + self.micro_batch_size]
                    rows.append(self._forward(self.model, mb, None)[:, -1].float())
                logits = torch.cat(rows) / temperature
                logits[:, PAD_ID] = float("-inf")
                probs = torch.softmax(logits, dim=-1).cpu()
                nxt = torch.multinomial(probs, 1, generator=generator).to(self.device)
                seqs = torch.cat([seqs, nxt], dim=1)
        return seqs

    # ------------------------------------------------------ reference weights
    def snapshot_reference(self) -> None:
        """Keep a copy of the current weights as the frozen reference policy (DPO)."""
        self._reference_state = _clone_state(self.model.state_dict())

    @contextlib.contextmanager
    def reference_weights(self) -> Iterator[None]:
        """Swap the reference weights into the SAME model for the duration (NeMo RL's way)."""
        if self._reference_state is None:
            raise RuntimeError("no reference weights: call snapshot_reference() first")
        current = _clone_state(self.model.state_dict())
        self.model.load_state_dict(self._reference_state)
        try:
            yield
        finally:
            self.model.load_state_dict(current)


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

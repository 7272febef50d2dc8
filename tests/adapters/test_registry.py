"""Expert-load counting on tiny Hugging Face MoE models (qwen3_moe, deepseek_v3) on CPU.

Expected counts come from the experts' own dispatch: a pre-hook on each ``*Experts`` module
records the ``top_k_index`` it is given, counted here with numpy.
"""

import numpy as np
import pytest
import torch

from nemo_moe_metrics import attach_collector

torch.set_num_threads(1)
E, K = 8, 2


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=E, num_experts_per_tok=K, decoder_sparse_step=1, mlp_only_layers=[],
        attn_implementation="eager",
    )  # fmt: skip
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).train()


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=K,
        n_group=2, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, attn_implementation="eager",
    )  # fmt: skip
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).train()
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            # A strong bias makes the real routing differ from topk(router_logits).
            m.e_score_correction_bias.copy_(torch.linspace(-1, 1, E))
            torch.nn.init.normal_(m.weight, std=0.2)
    return model


def _dispatch_probe(model):
    seen: dict[int, np.ndarray] = {}
    handles = []
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Experts"):
            layer = int(name.split("layers.")[1].split(".")[0])

            def pre(module, args, layer=layer):
                idx = args[1].reshape(-1).numpy()
                seen[layer] = seen.get(layer, 0) + np.bincount(idx, minlength=E)

            handles.append(m.register_forward_pre_hook(pre))
    return seen, handles


def _train_step(model, seed, batch=2, seq=12):
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()


def _qwen2_moe():
    # Qwen1.5-MoE / Qwen2-57B-A14B: softmax top-k router plus a sigmoid-gated shared expert that
    # every token goes through (not routed, so not counted).
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, num_experts=E, num_experts_per_tok=K, decoder_sparse_step=1,
        mlp_only_layers=[1], attn_implementation="eager",
    )  # fmt: skip
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg).train()


@pytest.mark.parametrize(
    "build,moe_layers", [(_qwen2_moe, [0, 2]), (_qwen3_moe, [0, 1]), (_deepseek_v3, [1, 2])]
)
def test_hf_counts_equal_experts_dispatch(build, moe_layers):
    model = build()
    collector = attach_collector(model)
    assert collector.layer_ids == moe_layers
    seen, _ = _dispatch_probe(model)
    for seed in range(2):
        _train_step(model, seed)
    loads = collector.export()
    expected = np.stack([seen[k] for k in moe_layers])
    np.testing.assert_array_equal(loads.counts, expected)
    assert loads.routed_tokens.tolist() == [2 * 2 * 12] * len(moe_layers)
    assert loads.counts.sum(axis=1).tolist() == [2 * 2 * 12 * K] * len(moe_layers)


def test_deepseek_v3_counts_are_not_topk_of_router_logits():
    model = _deepseek_v3()
    collector = attach_collector(model)
    naive = {}

    def grab(module, args, output):
        top = output[0].topk(K, dim=-1).indices.reshape(-1).numpy()
        naive[module] = np.bincount(top, minlength=E)

    for m in model.modules():
        if type(m).__name__ == "DeepseekV3TopkRouter":
            m.register_forward_hook(grab)
    _train_step(model, 0)
    loads = collector.export()
    assert not np.array_equal(loads.counts, np.stack(list(naive.values())))


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_counts_once(reentrant):
    plain = _qwen3_moe()
    ckpt = _qwen3_moe()
    ckpt.load_state_dict(plain.state_dict())
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    for m in ckpt.modules():
        if type(m).__name__ == "Qwen3MoeTopKRouter":
            m.register_forward_hook(lambda *a: calls.append(1))
    counts = []
    for model in (plain, ckpt):
        collector = attach_collector(model)
        _train_step(model, 3)
        counts.append(collector.export().counts)
    assert len(calls) == 2 * 2, "checkpointing must really replay the routers in backward"
    np.testing.assert_array_equal(counts[0], counts[1])


def test_hf_eval_and_no_grad_forwards_add_nothing():
    model = _qwen3_moe()
    collector = attach_collector(model)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        model(input_ids=ids)  # e.g. reference-model log-probs in train mode
    model.eval()
    model(input_ids=ids)
    loads = collector.export()
    assert loads.counts.sum() == 0 and loads.routed_tokens.sum() == 0


def test_dense_model_gets_no_hooks():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    assert attach_collector(model) is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_detach_removes_every_hook():
    model = _qwen3_moe()
    collector = attach_collector(model)
    collector.detach()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())

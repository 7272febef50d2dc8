"""Host staging (``moe.deferred.HostStaging``): the memory the trackers keep forwards in.

Copies reused round after round; a tensor several trackers keep from one forward copied once;
and a step whose kept forwards pass ``FLUSH_BYTES`` again and again (every tracker's batched
pass run mid-step, on what each kept so far) logs what the same step kept whole logs.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from nemo_moe_metrics.moe.deferred import HostStaging  # noqa: E402


def test_host_staging_copies_and_reuses_one_buffer_per_dtype_after_the_first_round():
    staging = HostStaging()
    gen = torch.Generator().manual_seed(1)
    sources = [torch.randn(700, 8, generator=gen) for _ in range(4)]  # past the first buffer
    kept = [staging.keep(t) for t in sources] + [staging.keep(torch.ones(5, dtype=torch.bool))]
    assert all(torch.equal(k, t) for k, t in zip(kept, sources, strict=False))
    assert kept[-1].all() and kept[0].data_ptr() != sources[0].data_ptr()  # copies
    staging.reset()
    # The next round fits one buffer sized by the first: every copy in the same storage
    again = [staging.keep(t) for t in sources]
    assert all(torch.equal(k, t) for k, t in zip(again, sources, strict=True))
    storages = {k.untyped_storage().data_ptr() for k in again}
    assert len(storages) == 1
    staging.reset()
    assert staging.keep(sources[0]).untyped_storage().data_ptr() in storages


def test_host_staging_copies_a_tensor_once_per_round_while_its_values_are_the_same():
    staging, consumed = HostStaging(dedup=True), []
    staging.add_consumer(lambda: consumed.append(staging.nbytes))
    ids = torch.arange(12, dtype=torch.int64).reshape(6, 2)
    first = staging.keep(ids)
    # Another view of the same memory, shape and strides (a tracker's own reshape): one copy
    assert staging.keep(ids.reshape(6, -1)) is first
    assert staging.nbytes == ids.numel() * ids.element_size()
    # Other strides, or values written since: a copy of their own
    assert staging.keep(ids.t()) is not first
    assert torch.equal(staging.keep(ids.t()), ids.t())
    ids.add_(1)
    again = staging.keep(ids)
    assert again is not first and torch.equal(again, ids) and not torch.equal(first, ids)
    staging.flush()  # every consumer passes over what is kept, then the memory is reused
    assert consumed and consumed[0] > 0 and staging.nbytes == 0
    assert staging.keep(ids) is not again and torch.equal(staging.keep(ids), ids)
    # Without dedup (a caller's buffer, written through numpy between keeps): a copy each time
    plain = HostStaging()
    lengths = torch.tensor([3, 5])
    before = plain.keep(lengths)
    lengths.numpy()[:] = [4, 4]  # no version bump
    assert plain.keep(lengths).tolist() == [4, 4] and before.tolist() == [3, 5]


def test_host_staging_keeps_a_tensor_off_the_host_by_reference_counting_its_bytes():
    # The meta device stands in for an accelerator: not the host, so no copy and no dedup
    staging = HostStaging(dedup=True)
    logits = torch.empty(4, 8, device="meta", requires_grad=True)
    kept = [staging.keep(logits), staging.keep(logits)]
    assert all(k.device.type == "meta" and not k.requires_grad for k in kept)
    assert staging.nbytes == 2 * 4 * 8 * 4  # the flush bound sees every reference
    staging.reset()
    assert staging.nbytes == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_step_flushed_mid_step_logs_what_the_step_kept_whole_logs(family, monkeypatch):
    pytest.importorskip("transformers")
    from hf_families import shared_tiny_model

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.moe import collector, health_tracker, hf_aux_loss
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    model = shared_tiny_model(family)
    cfg = MetricsConfig(
        track_moe_metrics=True, moe_per_layer_logging=True, track_router_health=True
    )
    vocab = model.config.get_text_config().vocab_size

    def step() -> dict:
        metrics = PolicyMetrics(cfg)
        metrics.attach(model, model.config)
        try:
            torch.manual_seed(3)
            with metrics.step():
                for _ in range(2):  # two microbatches, padded rows in each
                    ids = torch.randint(0, vocab, (3, 9))
                    mask = torch.ones_like(ids)
                    mask[0, 5:] = 0
                    mask[2, 7:] = 0
                    metrics.microbatch(seq_lens=mask.sum(-1))
                    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
            model.zero_grad(set_to_none=True)
            return metrics.finish_step(num_microbatches=2)
        finally:
            metrics.detach()

    whole = step()
    assert whole[mn.ROUTED_TOKENS] == 2 * (27 - 4 - 2)  # real tokens only
    assert any(key.startswith("moe/router_") for key in whole)
    # qwen3_moe trains with transformers' load-balancing loss; deepseek_v3 has none
    assert (mn.aux_loss_key("load_balancing_loss") in whole) == (family == "qwen3_moe")
    # A pass before every kept tensor, and one every few layer forwards (each keeps 1-2 KB)
    for flush_bytes in (1, 3000):
        for module in (collector, health_tracker, hf_aux_loss):
            monkeypatch.setattr(module, "FLUSH_BYTES", flush_bytes)
        _assert_same(whole, step())


def _assert_same(whole: dict, flushed: dict) -> None:
    from nemo_moe_metrics.export import metric_names as mn

    assert whole[mn.EXPERT_LOADS] == flushed[mn.EXPERT_LOADS]
    assert set(whole) == set(flushed)
    for key, value in whole.items():
        if isinstance(value, float) and math.isfinite(value):
            assert flushed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key

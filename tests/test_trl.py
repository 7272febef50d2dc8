"""MoEMetricsCallback in transformers' Trainer and TRL 1.16's SFT, DPO and GRPO trainers (CPU).

Every count is checked against :class:`trl_tiny.ExpertsOracle`, an independent hook on the
experts' inputs over the real tokens of training forwards (generation forwards apart). The
callback is added the ordinary way (``callbacks=[...]`` or ``add_callback``), with gradient
accumulation 2 and padded batches. On CI (``CI=true`` or ``NEMO_MOE_METRICS_REQUIRE_TRL=1``) a
missing TRL fails these tests instead of skipping them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REQUIRE = os.environ.get("CI") == "true" or os.environ.get("NEMO_MOE_METRICS_REQUIRE_TRL") == "1"
try:
    import trl  # noqa: F401
except ImportError as err:  # pragma: no cover - CI installs the 'trl' extra
    if REQUIRE:
        raise ImportError(f"TRL is required on CI (pip install -e '.[test]'): {err}") from err
    pytest.skip(f"TRL is not installed ({err}); pip install -e '.[trl]'", allow_module_level=True)

import torch  # noqa: E402
import trl_tiny as tt  # noqa: E402
from html_page_check import check_page  # noqa: E402

from nemo_moe_metrics.config import MetricsConfig  # noqa: E402
from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, EXPERTS = 2, 4
FLAGS = MetricsConfig(
    track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True, track_flops=True
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tt.save_tiny_model(tmp_path_factory.mktemp("tiny_moe"))


def make_trainer(kind: str, model_dir: Path, out: Path, callbacks: list, **overrides):
    """One of the four trainers on the tiny model (the example's builder), 2 steps."""
    return tt.build_trainer(kind, model_dir, out, callbacks, **{"max_steps": 2, **overrides})


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def train_with_oracle(trainer, callback) -> tt.ExpertsOracle:
    oracle = tt.ExpertsOracle(trainer.model, EXPERTS)
    trainer.train()
    oracle.remove()
    return oracle


def assert_counts_match(callback, oracle: tt.ExpertsOracle) -> None:
    logged = tt.logged_counts(callback.last_metrics, LAYERS, EXPERTS)
    for layer in range(LAYERS):
        assert logged[layer] == oracle.train[layer].tolist(), f"layer {layer}"
    assert callback.last_metrics["moe/routed_tokens"] == oracle.tokens("train")


@pytest.mark.parametrize("kind", ["trainer", "sft", "dpo", "grpo"])
def test_counts_equal_the_experts_real_training_tokens_and_keys_reach_log_history(
    kind, model_dir, tmp_path
):
    # One logging window over both steps: its counts are the two steps' counts summed.
    callback = MoEMetricsCallback(FLAGS)
    trainer = make_trainer(kind, model_dir, tmp_path, [callback], logging_steps=2)
    oracle = train_with_oracle(trainer, callback)
    assert trainer.callback_handler.callbacks[0] is callback
    assert_counts_match(callback, oracle)
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == 1 and history[0]["step"] == 2
    logged = history[0]
    assert logged["moe/routed_tokens"] == oracle.tokens("train")
    assert logged["train_perf/tokens"] == oracle.tokens("train")
    for key in ("moe/load_balancing_loss", "moe/max_over_ideal", "moe/layer_1/max_over_ideal"):
        assert key in logged
    assert "moe/expert_loads" not in logged  # the table goes to the run directory, not the logs


def test_keys_reach_tensorboard_whatever_the_callback_order(model_dir, tmp_path):
    callback = MoEMetricsCallback(FLAGS)
    trainer = make_trainer("sft", model_dir, tmp_path, [], report_to=["tensorboard"])
    trainer.add_callback(callback)  # after the Trainer was built: on_init_end never reached it
    assert trainer.callback_handler.callbacks[-1] is callback
    train_with_oracle(trainer, callback)
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events, "the Trainer wrote no TensorBoard file"
    scalars = read_scalars(events[0].parent)  # TensorBoard's own reader
    steps = [step for step, _ in scalars["train/moe/routed_tokens"]]
    assert steps == [1, 2]
    history = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for step, value in scalars["train/moe/max_over_ideal"]:
        assert value == pytest.approx(history[step]["moe/max_over_ideal"], rel=1e-6)
    assert "train/train_perf/tokens_per_second" in scalars


def test_grpo_generation_is_a_rollout_and_out_of_train_perf(model_dir, tmp_path):
    from transformers import TrainerCallback

    class StepWallClock(TrainerCallback):  # the whole optimizer step, generation included
        def __init__(self):
            self.seconds = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self.began

    callback, clock = MoEMetricsCallback(FLAGS), StepWallClock()
    trainer = make_trainer("grpo", model_dir, tmp_path, [callback, clock], logging_steps=2)
    generate = trainer.model.generate
    pause = 0.3

    def slow_generate(*args, **kwargs):  # generation takes >= 0.3 s per call
        time.sleep(pause)
        return generate(*args, **kwargs)

    trainer.model.generate = slow_generate
    oracle = train_with_oracle(trainer, callback)
    out = callback.last_metrics
    assert oracle.rollout, "GRPO generated nothing"
    assert out["gen_perf/seconds"] >= 2 * pause  # one generation per optimizer step
    # The steps took the generation's time and more; train_perf/ has the rest, not the pauses.
    assert clock.seconds >= out["gen_perf/seconds"] >= 2 * pause
    training = clock.seconds - out["gen_perf/seconds"]
    assert out["train_perf/seconds"] == pytest.approx(training, abs=0.1)
    assert out["train_perf/tokens"] == oracle.tokens("train")
    assert_counts_match(callback, oracle)
    # The rollout's load: the generation forwards' real tokens (prefill and decode).
    ratios = []
    for layer in range(LAYERS):
        counts = oracle.rollout[layer]
        ratios.append(float(counts.max()) * EXPERTS / float(counts.sum()))
        assert out[f"moe/layer_{layer}/rollout_max_over_ideal"] == pytest.approx(ratios[-1])
    assert out["moe/rollout_max_over_ideal"] == pytest.approx(sum(ratios) / LAYERS)


def test_a_step_that_raises_leaves_the_next_usable(model_dir, tmp_path):
    callback = MoEMetricsCallback(FLAGS)
    trainer = make_trainer("trainer", model_dir, tmp_path, [callback], max_steps=1)
    calls = {"n": 0}

    def fail_second_microbatch(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")

    handle = trainer.model.register_forward_pre_hook(fail_second_microbatch, with_kwargs=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.train()
    handle.remove()
    oracle = train_with_oracle(trainer, callback)  # the same callback, a fresh train()
    assert_counts_match(callback, oracle)


def test_eval_and_no_grad_forwards_stay_out(model_dir, tmp_path):
    callback = MoEMetricsCallback(FLAGS)
    trainer = make_trainer("trainer", model_dir, tmp_path, [callback], max_steps=1)
    oracle = tt.ExpertsOracle(trainer.model, EXPERTS)
    trainer.train()
    before = callback.last_metrics["moe/routed_tokens"]
    trainer.model.eval()
    with torch.no_grad():
        trainer.model(input_ids=torch.tensor([[3, 4, 5]]))
    trainer.evaluate(trainer.train_dataset.select(range(2)))
    oracle.remove()
    assert before == oracle.tokens("train")
    assert not any(
        k.startswith("moe/") for h in trainer.state.log_history if "eval_loss" in h for k in h
    )


def _switch_loss(logits: list[torch.Tensor], mask: torch.Tensor | None, top_k: int) -> float:
    """E * sum_e f_e * P_e over the given layers' logits pooled, real tokens only when masked."""
    experts = logits[0].shape[-1]
    weight = torch.ones(logits[0].shape[0]) if mask is None else mask.reshape(-1).float()
    picks = torch.zeros(experts)
    probs = torch.zeros(experts)
    for layer_logits in logits:
        p = torch.softmax(layer_logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        one_hot = torch.zeros_like(p).scatter_(1, chosen, 1.0)
        picks += (one_hot * weight[:, None]).sum(0)
        probs += (p * weight[:, None]).sum(0)
    rows = weight.sum() * len(logits)
    return float(experts * (picks / rows * probs / rows).sum())


def test_trl_aux_loss_and_ours_both_reproduced_from_the_same_router_logits(model_dir, tmp_path):
    # TRL logs the model's own aux_loss: every layer's logits pooled, padding masked out, the
    # mean over the window's microbatches. Ours: per layer (padding in, as transformers' function
    # without a mask), the mean over layers, then over microbatches. Same logits, two numbers.
    callback = MoEMetricsCallback(MetricsConfig(track_moe_metrics=True))
    trainer = make_trainer("sft", model_dir, tmp_path, [callback], max_steps=1)
    captured: list[dict] = []

    def on_model(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            captured.append({"mask": kwargs.get("attention_mask"), "logits": {}})

    def on_gate(layer):
        def hook(module, args, output):
            if module.training and torch.is_grad_enabled():
                captured[-1]["logits"].setdefault(layer, output[0].detach().clone())

        return hook

    model = trainer.model
    handles = [model.register_forward_pre_hook(on_model, with_kwargs=True)]
    handles += [layer.mlp.gate.register_forward_hook(on_gate(i))
                for i, layer in enumerate(model.model.layers)]  # fmt: skip
    trainer.train()
    for handle in handles:
        handle.remove()
    assert len(captured) == 2  # gradient accumulation 2: two training forwards
    logged = next(h for h in trainer.state.log_history if "aux_loss" in h)
    trl_expected = sum(
        _switch_loss([mb["logits"][i] for i in range(LAYERS)], mb["mask"], 2) for mb in captured
    ) / len(captured)
    assert logged["aux_loss"] == pytest.approx(trl_expected, rel=1e-5)
    ours_expected = sum(
        sum(_switch_loss([mb["logits"][i]], None, 2) for i in range(LAYERS)) / LAYERS
        for mb in captured
    ) / len(captured)
    assert logged["moe/load_balancing_loss"] == pytest.approx(ours_expected, rel=1e-5)
    assert logged["aux_loss"] != pytest.approx(logged["moe/load_balancing_loss"], rel=1e-4)


def test_router_aux_loss_coef_zero_trl_logs_none_we_log_the_diagnostic(model_dir, tmp_path):
    callback = MoEMetricsCallback(MetricsConfig(track_moe_metrics=True))
    trainer = make_trainer("sft", model_dir, tmp_path, [callback], max_steps=1,
                           router_aux_loss_coef=0.0)  # fmt: skip
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    assert "aux_loss" not in logged  # TRL neither trains on nor logs it
    assert logged["moe/load_balancing_loss"] > 0  # the balance diagnostic, coefficient excluded


def test_two_ranks_under_torchrun_reduce_the_counts_and_log_once(tmp_path, page_browser):
    import json
    import subprocess
    import sys

    from nemo_moe_metrics.testing import free_port

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    script = root / "tests" / "trl_ranks.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script), str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2
    oracle = result["oracle"]  # summed over both ranks
    assert [result["logged"][str(layer)] for layer in range(LAYERS)] == oracle
    (logged,) = result["history"]
    assert logged["moe/routed_tokens"] == sum(oracle[0]) // 2
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # one window, written once (rank 0)
    assert json.loads(lines[0])["moe/routed_tokens"] == logged["moe/routed_tokens"]
    # report --html of the callback's run: its counts are the store's (and, where Chromium
    # runs, the page opens offline without an error and hovers right).
    check_page(tmp_path / "run", page_browser, out_dir=tmp_path / "page")


def test_trackio_sink_and_report_to_trackio_side_by_side_in_the_run_directory(tmp_path):
    # Both read back through trackio's own API (trackio.sqlite_storage.SQLiteStorage).
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    store = tmp_path / "run" / "trackio"  # where the sink keeps it; report_to is pointed there
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_")}
    env.update(PYTHONPATH=str(root), HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRACKIO_DIR=str(store))  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "trl_trackio.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert store.is_dir() and not (tmp_path / "hf_home" / "trackio").exists()
    by_step = {row["step"]: row for row in got["sink"]}
    for logged in got["history"]:
        row = by_step[logged["step"]]  # our sink: the Trainer's global_step, keys as they are
        for key in ("moe/routed_tokens", "moe/max_over_ideal", "train_perf/tokens"):
            assert row[key] == pytest.approx(logged[key])
    # transformers' trackio callback prefixes training keys with train/, as for TensorBoard.
    rows = [row for row in got["report_to"] if "train/moe/routed_tokens" in row]
    assert [row["train/moe/routed_tokens"] for row in rows] == [
        h["moe/routed_tokens"] for h in got["history"]
    ]


def test_packed_position_ids_give_one_length_per_packed_sequence():
    from nemo_moe_metrics.integrations.transformers import forward_lengths

    lengths = [3, 5, 1, 4]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    ids = torch.zeros_like(positions)
    got = forward_lengths((), {"input_ids": ids, "position_ids": positions})
    assert got.tolist() == lengths + [0] * (sum(lengths) - len(lengths))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert forward_lengths((), {"input_ids": mask, "attention_mask": mask}).tolist() == [3, 2]


def test_generated_lengths_stop_at_the_first_end_of_sequence():
    from nemo_moe_metrics.integrations.transformers import generated_lengths

    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # left padding
    eos = 1
    sequences = torch.tensor([[0, 5, 6, 7, 1, 1, 1], [4, 5, 6, 7, 8, 9, 2]])
    # prompt 2 + completion "7 <eos>" = 4; prompt 3 + completion of 4, no eos = 7
    assert generated_lengths(prompt_mask, 3, sequences, [eos]).tolist() == [4, 7]

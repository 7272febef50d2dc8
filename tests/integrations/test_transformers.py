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
from nemo_moe_metrics.run_dir import RunDirBusyError, RunDirLock  # noqa: E402

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

    def end_likely(module, args, output):  # the end token ~30% likely: sequences end early
        output[..., trainer.model.config.eos_token_id] += 4.0

    def slow_generate(*args, **kwargs):  # generation takes >= 0.3 s per call
        time.sleep(pause)
        handle = trainer.model.lm_head.register_forward_hook(end_likely)
        try:
            return generate(*args, **kwargs)
        finally:
            handle.remove()

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
    # The rollout's load: the generation forwards' real tokens (prefill and decode), none
    # after a sequence's end (generate feeds padding there with attention mask 1).
    ratios = []
    for layer in range(LAYERS):
        counts, every = oracle.rollout[layer], oracle.rollout_all[layer]
        assert every.sum() > counts.sum(), "no sequence ended before the others: no test"
        ratios.append(float(counts.max()) * EXPERTS / float(counts.sum()))
        assert out[f"moe/layer_{layer}/rollout_max_over_ideal"] == pytest.approx(ratios[-1])
        assert ratios[-1] != pytest.approx(float(every.max()) * EXPERTS / float(every.sum()))
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
    # Beside it, the same per-layer loss over the real tokens only (padding out, as every
    # other moe/ count): transformers' function given the attention mask, layer by layer.
    real_expected = sum(
        sum(_switch_loss([mb["logits"][i]], mb["mask"], 2) for i in range(LAYERS)) / LAYERS
        for mb in captured
    ) / len(captured)
    real = logged["moe/load_balancing_loss_real_tokens"]
    assert real == pytest.approx(real_expected, rel=1e-5)
    assert real != pytest.approx(ours_expected, rel=1e-4)  # the batches are padded
    assert all(mb["mask"] is not None and not bool(mb["mask"].all()) for mb in captured)


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

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    script = root / "tests" / "support" / "trl_ranks.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script), str(tmp_path)]  # fmt: skip
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # While the job's rank 0 writes the run directory (paused after step 1), a second
        # training process on it is refused naming that rank, and no file of it changes.
        paused = tmp_path / "paused"
        deadline = time.monotonic() + 200
        while not paused.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert paused.exists(), job.communicate(timeout=60)[1][-3000:]
        holder = json.loads(paused.read_text())["pid"]
        run_dir = tmp_path / "run"
        files = _sha256s(run_dir)
        other = MoEMetricsCallback(FLAGS, run_dir=run_dir)
        second = make_trainer("sft", tmp_path / "model" / "rank0", tmp_path / "b", [other])
        with pytest.raises(RunDirBusyError, match=f"pid {holder} on host"):
            second.train()
        assert _sha256s(run_dir) == files
    finally:
        (tmp_path / "go").write_text("")
        out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-3000:]
    # LoggerConfig(table_every=1), as trl.md writes it: JSONL and the store, no second
    # TensorBoard or W&B run beside the Trainer's own.
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "wandb").exists()
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


def _sha256s(folder: Path, *, lock: bool = True) -> dict[str, str]:
    """Every file's digest (``lock=False``: not the lock file, in the process holding it:
    closing a descriptor of that file would drop the process's locks)."""
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and (lock or p.name != ".run.lock")
    }


class _StepTokens:
    """Independent: real tokens of every training forward, by the optimizer step it is in."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.tokens: dict[int, int] = {}
        self._step = 0
        outer = self

        class Steps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                outer._step = state.global_step + 1

        trainer.add_callback(Steps())
        self._handle = trainer.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            mask = kwargs.get("attention_mask")
            real = int(mask.sum()) if mask is not None else int(kwargs["input_ids"].numel())
            self.tokens[self._step] = self.tokens.get(self._step, 0) + real


def test_resume_from_checkpoint_continues_the_run_directory_each_step_once(
    model_dir, tmp_path, monkeypatch
):
    # Killed (an exception) at step 6 with checkpoints every 2 steps, then resumed from step 4:
    # every step once in metrics.jsonl and TensorBoard, the totals the sum of the steps', the
    # lock of the run that raised reclaimed, a short run's table stored at its end; a fresh
    # train() into the run is refused with the user's files untouched.
    import json

    from transformers import TrainerCallback

    from nemo_moe_metrics.config import LoggerConfig
    from nemo_moe_metrics.placement.loads import window_loads
    from nemo_moe_metrics.report import placement as report_placement
    from nemo_moe_metrics.report.summary import render_report
    from nemo_moe_metrics.run_dir.record import RunExistsError
    from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

    class Crash(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.global_step == 6:
                raise RuntimeError("killed at step 6")

    run_dir, out = tmp_path / "run", tmp_path / "trainer"
    flags = MetricsConfig(track_moe_metrics=True, track_throughput=True, track_router_health=True)
    logger = LoggerConfig(tensorboard_enabled=True)  # table_every 20: never reached
    saving = {"save_strategy": "steps", "save_steps": 2}
    first = MoEMetricsCallback(flags, run_dir=run_dir, logger=logger)
    trainer = make_trainer("sft", model_dir, out, [first, Crash()], max_steps=8, **saving)
    before = _StepTokens(trainer)
    with pytest.raises(RuntimeError, match="killed at step 6"):
        trainer.train()
    # The killed run stored no table (20-step cadence, never closed): say so, not "turn on".
    summary = render_report(run_dir, out_dir=tmp_path / "report")
    assert "no stored expert-load step yet" in summary and "did not close" in summary
    assert "log them with" not in summary
    with pytest.raises(ValueError, match="holds no train step yet") as err:
        window_loads(run_dir)
    assert "--steps" not in str(err.value)

    second = MoEMetricsCallback(flags, run_dir=run_dir, logger=logger)
    resumed = make_trainer("sft", model_dir, out, [second], max_steps=8, **saving)
    after = _StepTokens(resumed)
    with pytest.warns(RuntimeWarning, match="raised before its end"):
        resumed.train(resume_from_checkpoint=True)  # checkpoint-4, in this same thread
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 9))
    oracle = {**{s: n for s, n in before.tokens.items() if s <= 4}, **after.tokens}
    assert [line["train_perf/tokens"] for line in lines] == [oracle[s] for s in range(1, 9)]
    assert lines[-1]["train_perf/total_tokens"] == sum(oracle.values())
    assert lines[-1]["train_perf/total_seconds"] == pytest.approx(
        sum(line["train_perf/seconds"] for line in lines), rel=1e-6
    )
    scalars = read_scalars(run_dir / "tensorboard")
    assert [step for step, _ in scalars["train_perf/total_tokens"]] == list(range(1, 9))
    assert scalars["train_perf/total_tokens"][-1][1] == sum(oracle.values())
    # The last step's table, stored at the end although step 8 is off the 20-step cadence.
    (stored,) = list(read_expert_loads(store_path(run_dir)))
    assert stored.step == 8
    logged = tt.logged_counts(second.last_metrics, LAYERS, EXPERTS)
    assert stored.counts.tolist() == [logged[layer] for layer in range(LAYERS)]
    assert window_loads(run_dir).steps == 1
    drawn = []  # the report's placement_sweep.png figure, kept to read its axes
    monkeypatch.setattr(report_placement, "save_figure", lambda fig, path: drawn.append(fig))
    summary = render_report(run_dir, out_dir=tmp_path / "r2")
    assert "no stored expert-load step" not in summary
    # The router-health reference names this run's level (4 experts, top-2), not another's.
    assert "confidence 0.5 and entropy 1 for this run's 4 experts, top-2" in summary
    assert "8 experts" not in summary
    (sweep,) = [f for f in drawn if "redundant" in f.axes[0].get_xlabel()]
    ax = sweep.axes[0]
    assert all(float(t).is_integer() for t in ax.get_xticks())  # R counts experts
    assert {"layer 0", "layer 1"} <= {t.get_text() for t in ax.get_legend().get_texts()}

    files = _sha256s(run_dir)
    fresh = make_trainer(
        "sft", model_dir, tmp_path / "fresh", [MoEMetricsCallback(flags, run_dir=run_dir)]
    )
    with pytest.raises(RunExistsError, match="resume_from_checkpoint") as refused:
        fresh.train()
    assert "overwrite=True" in str(refused.value)
    assert _sha256s(run_dir) == files


def test_a_second_callback_is_refused_naming_the_first_and_the_lock_ends_with_training(
    model_dir, tmp_path
):
    # Two callback instances on one run directory (two trainers, the first mid-training in
    # another thread): the second is refused naming the first, whose files stay as they were;
    # the first gives the lock back when its training ends.
    import threading

    from transformers import TrainerCallback

    paused, go, failures = threading.Event(), threading.Event(), []

    class Pause(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                paused.set()
                go.wait(120)

    def train(trainer):
        try:
            trainer.train()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            failures.append(err)

    run_dir = tmp_path / "run"
    first = make_trainer(
        "sft", model_dir, tmp_path / "a", [MoEMetricsCallback(FLAGS, run_dir=run_dir), Pause()]
    )
    thread = threading.Thread(target=train, args=(first,))
    thread.start()
    try:
        assert paused.wait(120), failures
        files = _sha256s(run_dir, lock=False)
        holder = RunDirLock.probe(run_dir)
        second = make_trainer(
            "sft", model_dir, tmp_path / "b", [MoEMetricsCallback(FLAGS, run_dir=run_dir)]
        )
        with pytest.raises(RunDirBusyError, match=f"pid {os.getpid()} on host"):
            second.train()
        assert _sha256s(run_dir, lock=False) == files
        assert RunDirLock.probe(run_dir) == holder
    finally:
        go.set()
        thread.join(120)
    assert not failures
    assert RunDirLock.probe(run_dir) is None  # given back at on_train_end

"""MoEMetricsCallback through Megatron-Bridge's own CallbackManager around a real megatron loop.

Bridge's ``callbacks.py`` comes from the megatron-bridge 0.6.2 wheel, fetched from the registry
into a cache and loaded by file path (``nemo_moe_metrics.testing.load_bridge_callbacks``; the
full Bridge does not run on a CPU). The loop follows Bridge's ``train()`` event order:
``on_train_start``; per iteration ``on_train_step_start``, forward-backward through
``get_forward_backward_func`` under megatron's ``RerunStateMachine``, optimizer step,
``on_train_step_end``, ``train_state.step += 1``, then megatron's own aux-loss report the way
``training_log`` calls it (the last rank's writers, ``total_loss_dict`` on every rank).

One spawn of 2 gloo ranks runs three scenarios: expert parallel 2, expert parallel 2 with the
rerun state machine re-running every step's forward-backward (REPORT_DETERMINISM_STATS), and
pipeline parallel 2.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist import ok_values, run_ranks
from html_page_check import check_page

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.host_reads import HostReadCounter  # noqa: E402
from nemo_moe_metrics.sinks.base import split_tables  # noqa: E402
from nemo_moe_metrics.testing import load_bridge_callbacks  # noqa: E402

pytestmark = pytest.mark.megatron

SEQ, MICRO_BATCH, MICROBATCHES, STEPS = 16, 2, 2, 2
AUX_NAMES = ("load_balancing_loss", "z_loss")


class RecordingTensorBoard:
    """Bridge's ``state.tensorboard_logger`` (a SummaryWriter): records add_scalar calls."""

    def __init__(self):
        self.phase = ""
        self.calls: list[tuple[str, str, float, int]] = []

    def add_scalar(self, tag, value, step):
        self.calls.append((self.phase, tag, float(value), int(step)))


class RecordingWandb:
    """Bridge's ``state.wandb_logger`` (a wandb run): records log calls."""

    def __init__(self):
        self.phase = ""
        self.calls: list[tuple[str, dict, int]] = []

    def log(self, data, step):
        self.calls.append((self.phase, {k: float(v) for k, v in data.items()}, int(step)))


def _batches(rank: int, step: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed + 1000 * step + 7 * rank)
    out = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, 128, (MICRO_BATCH, SEQ), generator=gen)
        real = torch.randint(SEQ // 2, SEQ + 1, (MICRO_BATCH,), generator=gen)
        loss_mask = (torch.arange(SEQ).unsqueeze(0) < real.unsqueeze(1)).float()
        out.append(dict(tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=loss_mask))
    return out


def _forward_step(state, data_iterator, model, return_schedule_plan=False):
    """A forward step with Bridge's signature (what users pass to ``pretrain``)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    from nemo_moe_metrics.megatron.model import causal_attention_mask

    batch = next(data_iterator)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    output = model(
        batch["tokens"], position_ids, causal_attention_mask(SEQ), labels=batch["labels"]
    )
    loss_mask = batch["loss_mask"]

    def loss_func(output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
        get_rerun_state_machine().validate_result(
            result=loss, rejection_func=torch.isnan, message="loss", tolerance=0.0, fatal=False
        )
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _independent_router_counts(model, records: list) -> None:
    """Our own hook on megatron's routers: (pass, global layer, assignments per expert)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter):

            def hook(mod, args, output):
                if mod.training and torch.is_grad_enabled():
                    records.append((records_pass[0], mod.layer_number - 1, output[1].sum(0)))

            module.register_forward_hook(hook)


records_pass = [0]  # which forward-backward pass of the step the independent hook sees


def _scenario(rank, world, tmp: Path, name: str, layout, rerun: bool) -> dict:
    bridge = load_bridge_callbacks()  # first: the integration finds it as megatron.bridge's
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import (
        RerunDataIterator,
        RerunMode,
        destroy_rerun_state_machine,
        get_rerun_state_machine,
        initialize_rerun_state_machine,
    )
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from nemo_moe_metrics.config import MetricsConfig, ModelConfig
    from nemo_moe_metrics.integrations.megatron_bridge import MoEMetricsCallback
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names

    init_distributed(layout)
    compat.reset_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    dp = world // layout.pipeline_model_parallel_size
    dp_rank = parallel_state.get_data_parallel_rank()  # PP stages of a replica share its data
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(rank, None, MICRO_BATCH * MICROBATCHES * dp, MICRO_BATCH, dp)
    if rerun and not torch.cuda.is_available():
        # cpu-only: the machine saves and restores the CUDA RNG around a rerun.
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
        torch.cuda.set_rng_state = lambda *a, **k: None
    destroy_rerun_state_machine()
    initialize_rerun_state_machine(
        mode=RerunMode.REPORT_DETERMINISM_STATS if rerun else RerunMode.DISABLED
    )
    model_cfg = ModelConfig(num_layers=4, moe_z_loss_coeff=1e-3, seq_length=SEQ, vocab_size=100)
    torch.manual_seed(5)
    model = build_gpt_model(model_cfg.model_copy(update={"vocab_size": 128}), layout)
    config = build_transformer_config(model_cfg, layout)
    records: list = []
    _independent_router_counts(model, records)

    last = rank == world - 1
    tb, wb = (RecordingTensorBoard(), RecordingWandb()) if last else (None, None)
    bridge_model_cfg = SimpleNamespace(  # what Bridge's cfg.model says about the vocabulary
        vocab_size=model_cfg.vocab_size,
        should_pad_vocab=True,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
    )
    state = SimpleNamespace(
        cfg=SimpleNamespace(model=bridge_model_cfg, logger=SimpleNamespace(tensorboard_dir=None)),
        train_state=SimpleNamespace(step=0),
        tensorboard_logger=tb,
        wandb_logger=wb,
    )
    callback = MoEMetricsCallback(
        MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True),
        run_dir=tmp / name,
        table_every=1,
    )
    forward_step = callback.wrap_forward_step(_forward_step)
    # Host reads of the callback's per-microbatch work (length, rerun check, restart).
    microbatch_reads: list[int] = []
    for attr in ("_record", "_check_rerun"):
        inner = getattr(callback, attr)

        def counted(*args, _inner=inner):
            with HostReadCounter() as counter:
                _inner(*args)
            microbatch_reads.append(counter.total)

        setattr(callback, attr, counted)
    manager = bridge.normalize_callbacks([callback])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctx = functools.partial(bridge.CallbackContext, state=state, model=[model])

    def phase(label):
        for writer in (tb, wb):
            if writer is not None:
                writer.phase = label

    out: dict = dict(steps=[])
    manager.fire("on_train_start", ctx(user_state=manager.user_state, optimizer=optimizer))
    out["vocab"] = callback.metrics.vocab_size
    if name == "ep":
        out["second_writer"] = _second_writer(rank, world, tmp / name, ctx, manager, optimizer)
    machine = get_rerun_state_machine()
    # Megatron's determinism-stats log line reads Caller.filename, which Caller lacks
    # (AttributeError on rank 0 after a rerun); the log line is not what is tested here.
    machine._maybe_report_stats = lambda: None
    for step in range(STEPS):
        phase("ours")
        manager.fire("on_train_step_start", ctx(user_state=manager.user_state))
        data = RerunDataIterator(iter(_batches(dp_rank, step, seed=len(name))))
        records.clear()
        records_pass[0] = 0
        with cpu_device_mode():
            while machine.should_run_forward_backward(data):
                records_pass[0] += 1
                optimizer.zero_grad()
                get_forward_backward_func()(
                    forward_step_func=functools.partial(forward_step, state),
                    data_iterator=data,
                    model=[model],
                    num_microbatches=get_num_microbatches(),
                    seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH,
                    forward_only=False,
                )
        optimizer.step()
        tracker_before_report = {k: v.clone() for k, v in compat.tracker_values().items()}
        with HostReadCounter() as export_reads:
            manager.fire(
                "on_train_step_end",
                ctx(user_state=manager.user_state, loss_dict={}, grad_norm=0.0, skipped_iter=False),
            )
        tracker_after_ours = {k: v.clone() for k, v in compat.tracker_values().items()}
        state.train_state.step += 1
        phase("megatron")  # training_log: megatron's own report, Bridge's arguments
        total_loss_dict: dict = {}
        compat.megatron_report(
            config,
            loss_scale=1 / get_num_microbatches(),
            iteration=state.train_state.step,
            track_names=tracked_aux_loss_names(config),
            writer=tb,
            wandb_writer=wb,
            total_loss_dict=total_loss_dict,
            per_layer=True,
        )
        last_pass = max(p for p, _, _ in records) if records else 0
        independent: dict[int, list[int]] = {}
        for p, layer, counts in records:
            if p == last_pass:
                prev = independent.get(layer, [0] * counts.numel())
                independent[layer] = [a + int(b) for a, b in zip(prev, counts, strict=True)]
        batches = _batches(dp_rank, step, seed=len(name))
        out["steps"].append(
            dict(
                ours=callback.last_metrics,
                megatron_total={k: float(v) for k, v in total_loss_dict.items()},
                independent=independent,
                passes=records_pass[0],
                export_reads=export_reads.total,
                tokens=int(sum(b["loss_mask"].sum() for b in batches)),
                tracker_untouched=all(
                    torch.equal(tracker_before_report[k], tracker_after_ours[k])
                    for k in tracker_before_report
                ),
            )
        )
    manager.fire("on_train_end", ctx(user_state=manager.user_state))
    from nemo_moe_metrics.run_dir import RunDirLock

    out["held_after_end"] = RunDirLock.probe(tmp / name) is not None
    out["microbatch_reads"] = microbatch_reads
    out["tb"] = tb.calls if tb else None
    out["wandb"] = wb.calls if wb else None
    return out


def _sha256s(folder: Path) -> dict[str, str]:
    """Every file's digest but the lock's: closing any descriptor of the lock file would drop
    the locks this process (the holder) has on it; the holder it names is compared apart."""
    import hashlib

    from nemo_moe_metrics.run_dir import RunDirLock

    digests = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".run.lock"
    }
    return {**digests, ".run.lock": repr(RunDirLock.probe(folder))}


def _second_writer(rank, world, run_dir: Path, ctx, manager, optimizer) -> dict:
    """A second callback on the same run directory while the first writes (every rank fires
    its events; the last rank writes): refused naming the owner, files untouched, the model's
    hooks as before."""
    import os

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.integrations.megatron_bridge import MoEMetricsCallback
    from nemo_moe_metrics.run_dir import RunDirBusyError

    second = MoEMetricsCallback(MetricsConfig(track_moe_metrics=True), run_dir=run_dir)
    before = _sha256s(run_dir)
    refused = None
    try:
        second.on_train_start(ctx(user_state=manager.user_state, optimizer=optimizer))
    except RunDirBusyError as err:
        refused = str(err)
    if refused is None:
        second.on_train_end(ctx(user_state=manager.user_state))
    return dict(refused=refused, pid=os.getpid(), untouched=_sha256s(run_dir) == before)


def _all_scenarios(rank, world, tmp):
    from nemo_moe_metrics.config import MegatronConfig

    ep = MegatronConfig(expert_model_parallel_size=2)
    pp = MegatronConfig(pipeline_model_parallel_size=2)
    return {
        "ep": _scenario(rank, world, tmp, "ep", ep, rerun=False),
        "ep_rerun": _scenario(rank, world, tmp, "ep_rerun", ep, rerun=True),
        "pp": _scenario(rank, world, tmp, "pp", pp, rerun=False),
    }


@pytest.fixture(scope="module")
def bridge_run(tmp_path_factory):
    load_bridge_callbacks()  # fetch (or reuse) the wheel once, before the ranks start
    tmp = tmp_path_factory.mktemp("bridge")
    return tmp, ok_values(run_ranks(_all_scenarios, 2, tmp, timeout=240))


SCENARIOS = ["ep", "ep_rerun", "pp"]


def _megatron_written(calls, step):
    return {tag: v for phase, tag, v, s in calls if phase == "megatron" and s == step}


def _ours_written(calls, step):
    return {tag: v for phase, tag, v, s in calls if phase == "ours" and s == step}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_megatron_report_after_the_callback_is_nonzero_and_equals_ours(bridge_run, scenario):
    _, ranks = bridge_run
    last = ranks[-1][scenario]
    for i, step in enumerate(last["steps"]):
        iteration = i + 1
        megatron = _megatron_written(last["tb"], iteration)
        ours = _ours_written(last["tb"], iteration)
        for name in AUX_NAMES:
            assert megatron[name] > 0, (name, megatron)
            assert ours[f"moe/{name}"] == pytest.approx(megatron[name], rel=1e-6), name
            layer_keys = [k for k in ours if k.startswith(f"moe/{name}_layer_")]
            assert len(layer_keys) == 4
            for key in layer_keys:
                assert ours[key] == pytest.approx(megatron[key], rel=1e-6), key
        assert step["tracker_untouched"]  # shared by default: Bridge's report sees it all


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rank_gets_megatrons_total_loss_dict_values(bridge_run, scenario):
    _, ranks = bridge_run
    for result in ranks:
        for step in result[scenario]["steps"]:
            for name in AUX_NAMES:
                ours = step["ours"][f"moe/{name}"]
                assert ours == pytest.approx(step["megatron_total"][name], rel=1e-6), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_expert_counts_equal_independent_router_counts(bridge_run, scenario):
    from nemo_moe_metrics.export.metric_names import EXPERT_LOADS

    _, ranks = bridge_run
    for i in range(STEPS):
        expected: dict[tuple[int, int], int] = {}
        for result in ranks:
            for layer, counts in result[scenario]["steps"][i]["independent"].items():
                for expert, n in enumerate(counts):
                    expected[(layer, expert)] = expected.get((layer, expert), 0) + n
        rows = ranks[0][scenario]["steps"][i]["ours"][EXPERT_LOADS]
        ours = {(int(r[0]), int(r[1])): int(r[2]) for r in rows}
        assert ours == expected
        # 4 layers x 2 ranks' tokens (EP: different data per rank; PP: one replica) x top-2
        replicas = 2 if scenario.startswith("ep") else 1
        assert sum(ours.values()) == 4 * replicas * MICROBATCHES * MICRO_BATCH * SEQ * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tokens_are_the_loss_mask_tokens_of_the_data_parallel_ranks(bridge_run, scenario):
    _, ranks = bridge_run
    for i in range(STEPS):
        if scenario.startswith("ep"):  # data parallel 2: both ranks' batches
            expected = sum(r[scenario]["steps"][i]["tokens"] for r in ranks)
        else:  # pipeline parallel 2: one replica, its batch seen by both stages
            expected = ranks[0][scenario]["steps"][i]["tokens"]
        for result in ranks:
            assert result[scenario]["steps"][i]["ours"]["train_perf/tokens"] == expected


@pytest.mark.timeout(300)
def test_rerun_of_forward_backward_counts_the_step_once(bridge_run):
    _, ranks = bridge_run
    for result in ranks:
        assert all(s["passes"] == 2 for s in result["ep_rerun"]["steps"])
        assert all(s["passes"] == 1 for s in result["ep"]["steps"])
    # The same data and weights: counted once, the rerun step equals the plain step's numbers
    # of its last run; aux losses once (megatron's report too: the tracker was put back).
    last = ranks[-1]["ep_rerun"]
    for i in range(STEPS):
        megatron = _megatron_written(last["tb"], i + 1)
        assert megatron["load_balancing_loss"] == pytest.approx(
            last["steps"][i]["ours"]["moe/load_balancing_loss"], rel=1e-6
        )
        # A doubled tracker would report about 2x the balanced minimum of 1.0.
        assert 0.9 < megatron["load_balancing_loss"] < 1.5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scalars_reach_bridges_writers_at_training_logs_iteration(bridge_run, scenario):
    _, ranks = bridge_run
    last = ranks[-1][scenario]
    for i, step in enumerate(last["steps"]):
        ours_tb = _ours_written(last["tb"], i + 1)
        scalars, _ = split_tables(step["ours"])  # the table (an ExpertTable) is not a scalar
        assert ours_tb == pytest.approx(scalars)
        (logged,) = [d for phase, d, s in last["wandb"] if phase == "ours" and s == i + 1]
        assert logged == pytest.approx(scalars)
    assert {s for _, _, _, s in last["tb"]} == {1, 2}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rank_without_writers_writes_nothing_and_the_store_has_each_step_once(bridge_run, scenario):
    from nemo_moe_metrics.export.metric_names import EXPERT_LOADS
    from nemo_moe_metrics.sinks.store import read_expert_loads, scan_store, store_path

    tmp, ranks = bridge_run
    assert ranks[0][scenario]["tb"] is None and ranks[0][scenario]["wandb"] is None
    path = store_path(tmp / scenario)
    with path.open("rb") as f:  # raw records: a second writer would append its own
        entries = scan_store(f, path.stat().st_size).entries
    assert [e.step for e in entries] == [1, 2]
    (first, _, counts), _ = list(read_expert_loads(path))
    rows = ranks[0][scenario]["steps"][0]["ours"][EXPERT_LOADS]
    assert first == 1 and int(counts.sum()) == sum(int(r[2]) for r in rows)


@pytest.mark.timeout(300)
def test_report_html_of_the_callbacks_run_shows_the_stores_counts(
    bridge_run, page_browser, tmp_path
):
    # The page of a run the Megatron-Bridge callback wrote (tests/support/html_page_check.py; in the
    # browser where Chromium runs).
    tmp, _ = bridge_run
    check_page(tmp / "ep", page_browser, out_dir=tmp_path)


@pytest.mark.timeout(300)
def test_padded_vocabulary_comes_from_bridges_model_config(bridge_run):
    _, ranks = bridge_run
    assert all(r["ep"]["vocab"] == 128 for r in ranks)  # 100 padded to a multiple of 128


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_callback_reads_the_device_once_per_step_and_never_per_microbatch(bridge_run, scenario):
    _, ranks = bridge_run
    for result in ranks:
        assert result[scenario]["microbatch_reads"]  # the wrapper ran
        assert set(result[scenario]["microbatch_reads"]) == {0}
        # Steady state: finish_step's one host read (the writers get Python numbers); the
        # first export also agrees on the layer layout across ranks.
        assert [s["export_reads"] for s in result[scenario]["steps"]][1:] == [1] * (STEPS - 1)


def test_a_second_writer_is_refused_naming_the_owner_and_the_lock_ends_with_training(bridge_run):
    _, results = bridge_run
    last = results[-1]["ep"]["second_writer"]  # the last rank writes the run directory
    assert last["refused"] is not None and f"pid {last['pid']} on host" in last["refused"]
    assert last["untouched"]
    assert results[0]["ep"]["second_writer"]["refused"] is None  # other ranks write nothing
    assert not any(results[-1][name]["held_after_end"] for name in SCENARIOS)  # the writer

"""MLflow sink through build_sinks: everything read back with MlflowClient from the SQLite store.

One module fixture logs a run into a fresh run directory (MLflow creates its SQLite tables
once: the slow part), closes it, and continues it with ``logger.resume``; the tests read it.
"""

import csv
import json
import random
import warnings
from pathlib import Path

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.runtime.extras import MissingExtraError
from nemo_moe_metrics.sinks import RUN_FILE, build_sinks, logged_run

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
from mlflow.tracking import MlflowClient  # noqa: E402

pytestmark = pytest.mark.megatron

CFG = LoggerConfig(
    tensorboard_enabled=False, wandb_enabled=False, mlflow_enabled=True, table_every=2
)
LAYERS, EXPERTS = (1, 3), 4
FIRST, SECOND = range(0, 5), range(5, 9)


def _step_metrics(step: int) -> dict:
    rng = random.Random(step)
    table = []
    for layer in LAYERS:
        counts = [rng.randrange(0, 500) for _ in range(EXPERTS)]
        total = sum(counts) or 1
        table += [[layer, e, c, 100.0 * c / total] for e, c in enumerate(counts)]
    return {
        mn.MAX_OVER_IDEAL: 1.0 + step / 7,
        mn.TOKENS: 512 + step,
        "moe/load_balancing_loss": 0.01 * (step + 1) / 3,
        mn.EXPERT_LOADS: table,
    }


def _log(run_dir, cfg, steps, **kw):
    sink = build_sinks(cfg, run_dir, run_name="mlrun", config={"logger": {"x": 1}}, **kw)
    for step in steps:
        sink.log(_step_metrics(step), step=step)
    sink.close()
    return json.loads((run_dir / RUN_FILE).read_text())["mlflow_run_id"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mlflow_run")
    first_id = _log(run_dir, CFG, FIRST)
    second_id = _log(run_dir, CFG.model_copy(update={"resume": True}), SECOND)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    return run_dir, first_id, second_id, client


def test_resume_continues_the_same_mlflow_run_in_the_run_directory(run):
    run_dir, first_id, second_id, client = run
    assert (run_dir / "mlflow.db").is_file()
    assert first_id == second_id
    info = client.get_run(first_id).info
    assert info.status == "FINISHED" and info.run_name == "mlrun"
    assert info.artifact_uri.startswith((run_dir / "mlflow_artifacts").resolve().as_uri())
    experiment = client.get_experiment_by_name("nemo_moe_metrics")
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_metric_history_per_key_and_step_equals_what_was_logged(run):
    _, run_id, _, client = run
    steps = [*FIRST, *SECOND]
    for key in (mn.MAX_OVER_IDEAL, mn.TOKENS, "moe/load_balancing_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(s, float(_step_metrics(s)[key])) for s in steps], key
    assert mn.EXPERT_LOADS not in client.get_run(run_id).data.metrics


def test_expert_table_is_one_csv_artifact_per_table_step_with_the_counts(run, tmp_path):
    _, run_id, _, client = run
    names = sorted(a.path for a in client.list_artifacts(run_id, "expert_loads"))
    table_steps = [s for s in [*FIRST, *SECOND] if s % CFG.table_every == 0]
    assert names == [f"expert_loads/step_{s:08d}.csv" for s in table_steps]
    local = client.download_artifacts(run_id, "expert_loads", str(tmp_path))
    for step in table_steps:
        with open(f"{local}/step_{step:08d}.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["layer", "expert", "tokens", "load_percent"]
        want = _step_metrics(step)[mn.EXPERT_LOADS]
        got = [[int(r[0]), int(r[1]), int(r[2]), float(r[3])] for r in rows[1:]]
        assert got == want  # floats round-trip exactly (repr)
    config_file = client.download_artifacts(run_id, "config.json", str(tmp_path))
    config = json.loads(Path(config_file).read_text())
    assert config == {"logger": {"x": 1}}


def test_tracking_uri_setting_logs_elsewhere(run, tmp_path):
    run_dir, first_id, _, client = run
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    other = tmp_path / "other"
    # A new experiment in a given store keeps its artifacts where MLflow's default says (./mlruns
    # for a SQLite URI); the test creates it first with its artifacts under tmp_path.
    client.create_experiment("second", artifact_location=(tmp_path / "art").as_uri())
    cfg = CFG.model_copy(update={"mlflow_tracking_uri": uri, "mlflow_experiment": "second"})
    run_id = _log(other, cfg, [4])
    assert not (other / "mlflow.db").exists() and run_id != first_id
    assert client.get_run(run_id).data.metrics[mn.TOKENS] == 516
    assert client.get_experiment_by_name("second") is not None
    # Without JSONL the local MLflow store alone marks the directory as holding a run.
    only = tmp_path / "only_mlflow"
    only.mkdir()
    (only / "mlflow.db").write_bytes((run_dir / "mlflow.db").read_bytes())
    assert logged_run(only) == ["mlflow.db"]


def test_missing_extra_names_it(monkeypatch, tmp_path):
    from nemo_moe_metrics.runtime import extras
    from nemo_moe_metrics.sinks.mlflow import MlflowSink

    monkeypatch.setattr(extras, "_installed", lambda module: module != "alembic")
    with pytest.raises(MissingExtraError, match=r"'mlflow' extra .*nemo_moe_metrics\[mlflow\]"):
        MlflowSink(tmp_path, run_name="r")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink = build_sinks(CFG.model_copy(update={"jsonl_enabled": False}), tmp_path, run_name="r")
    assert sink.sinks == []
    assert any("nemo_moe_metrics[mlflow]" in str(w.message) for w in caught)


def test_bridge_callback_logs_scalars_and_tables_to_mlflow(run, tmp_path):
    from types import SimpleNamespace

    from nemo_moe_metrics.testing import load_bridge_callbacks

    try:
        load_bridge_callbacks()
    except Exception as err:  # no cached wheel and no registry: the Bridge tests cover it
        pytest.skip(f"Bridge's callbacks.py not available: {err}")
    from nemo_moe_metrics.integrations.megatron_bridge import MoEMetricsCallback

    run_dir, _, _, client = run
    client.create_experiment("bridge", artifact_location=(tmp_path / "art").as_uri())
    callback = MoEMetricsCallback(
        {"track_moe_metrics": True, "log_expert_table": True},
        run_dir=tmp_path / "bridge_run",
        table_every=2,
        mlflow_enabled=True,
        mlflow_tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}",
        mlflow_experiment="bridge",
    )
    state = SimpleNamespace(cfg=SimpleNamespace(logger=None))
    callback._open_store(state)  # what on_train_start does on the last rank, after attaching
    for iteration in (1, 2):
        callback._write(state, _step_metrics(iteration), iteration)
    callback.on_train_end(SimpleNamespace(state=state))
    [bridge_run] = client.search_runs([client.get_experiment_by_name("bridge").experiment_id])
    run_id = bridge_run.info.run_id
    assert bridge_run.info.run_name == "bridge_run" and bridge_run.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, mn.TOKENS))
    assert history == [(1, 513.0), (2, 514.0)]
    names = [a.path for a in client.list_artifacts(run_id, "expert_loads")]
    assert names == ["expert_loads/step_00000002.csv"]

"""The output rule (``nemo_moe_metrics.run_dir.outputs``), through the real CLI: ``placement``,
``ingest sglang`` and ``report --out`` write only what the user named or a checked run
directory holds; every refusal is one line naming the path, and leaves the user's files
byte-identical (sha256 before and after)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile_files import fingerprint

from nemo_moe_metrics.cli import main
from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.run_dir.outputs import OutputError, check_new_file, write_new_file
from nemo_moe_metrics.sinks import build_sinks

pytestmark = pytest.mark.one_line


def _run(run_dir: Path, steps: int = 8) -> Path:
    """A real run directory: metrics.jsonl, run.json and the store, 2 layers x 8 experts."""
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    sink = build_sinks(cfg, run_dir, run_name="r")
    rng = np.random.default_rng(0)
    for step in range(steps):
        rows = [[la, e, int(rng.integers(1, 100)), 0.0] for la in (1, 2) for e in range(8)]
        sink.log({mn.EXPERT_LOADS: rows, mn.TOKENS: 8.0}, step)
    sink.close()
    return run_dir


def _refused(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


@pytest.fixture
def run(tmp_path):
    return _run(tmp_path / "run")


def test_out_never_replaces_an_existing_file_without_force(tmp_path, run, capsys):
    mine = tmp_path / "mine" / "PLAN.json"
    mine.parent.mkdir()
    mine.write_text("the user's own plan\n")
    before = fingerprint(tmp_path)
    argv = ["placement", str(run), "--ep-size", "2", "--out", str(mine)]
    _refused(capsys, argv, str(mine), "exists", "--force")
    assert fingerprint(tmp_path) == before
    assert main([*argv, "--force"]) == 0  # consent: replaced, and nothing else changed
    assert json.loads(mine.read_text())["ep_size"] == 2
    after = fingerprint(tmp_path)
    assert {k for k in after if after[k] != before.get(k)} == {"mine/PLAN.json"}


def test_out_never_writes_through_or_over_a_link_even_with_force(tmp_path, run, capsys):
    target = tmp_path / "precious.json"
    target.write_text("keep\n")
    link = tmp_path / "PLAN.json"
    link.symlink_to(target)
    before = fingerprint(tmp_path)
    argv = ["placement", str(run), "--ep-size", "2", "--out", str(link), "--force"]
    _refused(capsys, argv, str(link), "symbolic link", "precious.json")
    assert fingerprint(tmp_path) == before and link.is_symlink()


def test_out_writes_no_sibling_the_user_did_not_name(tmp_path, run, capsys):
    plans = tmp_path / "plans"
    plans.mkdir()
    for name in ("PLAN.sglang.json", "PLAN.vllm_eplb_config.json", "placement_sweep.png"):
        (plans / name).write_text(f"the user's {name}\n")
    before = fingerprint(plans)
    argv = ["placement", str(run), "--ep-size", "2", "--sweep", "--out", str(plans / "PLAN.json")]
    assert main(argv) == 0
    after = fingerprint(plans)
    assert {k: v for k, v in after.items() if k != "PLAN.json"} == before
    assert (run / "placement_sweep.png").stat().st_size > 0  # the run's own picture
    # Engine files only by name: they are written where the user said.
    sglang, vllm = plans / "s.json", plans / "v.json"
    assert main([*argv, "--force", "--sglang-out", str(sglang), "--vllm-out", str(vllm)]) == 0
    assert list(json.loads(sglang.read_text())) == ["physical_to_logical_map"]
    assert json.loads(vllm.read_text()) == {"num_redundant_experts": 0}


def test_out_never_replaces_a_run_file(tmp_path, run, capsys):
    before = fingerprint(run)
    for force in ([], ["--force"]):
        argv = ["placement", str(run), "--ep-size", "2", "--out", str(run / "metrics.jsonl")]
        _refused(capsys, [*argv, *force], "metrics.jsonl", "the run's own files")
    assert fingerprint(run) == before
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 8


def test_out_naming_a_directory_is_one_line(tmp_path, run, capsys):
    _refused(
        capsys, ["placement", str(run), "--ep-size", "2", "--out", str(tmp_path)], "a directory"
    )


def test_ingest_writes_only_into_a_run_directory(tmp_path, run, capsys):
    dump = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"logical_count": torch.ones(2, 2, 8, dtype=torch.int32)}, dump)
    user = tmp_path / "project"
    (user / ".git").mkdir(parents=True)
    (user / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (user / "notes.txt").write_text("mine\n")
    before = fingerprint(user)
    argv = ["ingest", "sglang", str(dump), "--step", "3", "--run"]
    _refused(capsys, [*argv, str(user)], str(user), "not a run directory", ".git, notes.txt")
    assert fingerprint(user) == before
    # A run directory, or a new one, is written.
    assert main([*argv, str(run)]) == 0
    assert (run / "rollout_expert_loads.bin").is_file()
    assert main([*argv, str(tmp_path / "new_run")]) == 0
    assert sorted(p.name for p in (tmp_path / "new_run").iterdir()) == ["rollout_expert_loads.bin"]


def test_ingest_never_writes_through_a_linked_store(tmp_path, run, capsys):
    dump = tmp_path / "d.pt"
    torch.save({"logical_count": torch.ones(1, 2, 8, dtype=torch.int32)}, dump)
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"the user's bytes")
    (run / "rollout_expert_loads.bin").symlink_to(target)
    before = fingerprint(tmp_path)
    argv = ["ingest", "sglang", str(dump), "--step", "3", "--run", str(run)]
    _refused(capsys, argv, "rollout_expert_loads.bin", "symbolic link")
    assert fingerprint(tmp_path) == before


def test_report_out_never_replaces_a_users_file_or_a_link(tmp_path, run, capsys):
    user = tmp_path / "pictures"
    user.mkdir()
    (user / "notes.txt").write_text("mine\n")
    (user / "routing_drift.png").write_text("my own drawing\n")
    before = fingerprint(user)
    _refused(capsys, ["report", str(run), "--out", str(user)], "routing_drift.png", "replace")
    assert fingerprint(user) == before
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "expert_load_heatmap.png").symlink_to(tmp_path / "pictures" / "notes.txt")
    _refused(capsys, ["report", str(run), "--out", str(linked)], "symbolic link")
    assert fingerprint(user) == before
    # A new directory, and the same one again (the report's own pictures), are fine.
    assert main(["report", str(run), "--out", str(tmp_path / "new")]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "new")]) == 0


def test_write_new_file_links_into_place_and_never_clobbers(tmp_path):
    path = check_new_file(tmp_path / "a" / "x.json", option="--out")
    write_new_file(path, b"one")
    assert path.read_bytes() == b"one"
    with pytest.raises(OutputError, match="appeared while it was being written"):
        write_new_file(path, b"two")  # checked before, then something appeared: not replaced
    assert path.read_bytes() == b"one"
    write_new_file(path, b"three", force=True)
    assert path.read_bytes() == b"three"
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]  # no temporary left

"""``run`` refuses a directory that holds no run of its own before its lock file is created:
``--resume`` into a user's directory and ``--overwrite`` of a user's ``metrics.jsonl`` leave
it byte-identical, with no ``.run.lock`` behind (through the real CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile_files import REPO, fingerprint

from nemo_moe_metrics.cli import main
from tests.e2e.test_cli_ux import cli_in_clean_home

pytestmark = pytest.mark.one_line

RECIPE = str(REPO / "examples" / "configs" / "sft_moe_tiny.yaml")


def _user_dir(root: Path, name: str, text: str) -> Path:
    run_dir = root / "sft_moe_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / name).write_text(text)
    return run_dir


@pytest.mark.parametrize(
    "name,text,flag,words",
    [
        ("notes.txt", "mine\n", "--resume", ["files no run wrote (notes.txt)", "drop --resume"]),
        ("metrics.jsonl", '{"mine": 1}\n', "--overwrite", ["no mark of a run", "not deleted"]),
        ("metrics.jsonl", '{"mine": 1}\n', "--resume", ["no mark of a run", "drop --resume"]),
    ],
)
def test_a_refused_run_leaves_no_lock_in_a_users_directory(
    tmp_path, capsys, name, text, flag, words
):
    run_dir = _user_dir(tmp_path / "out", name, text)
    before = fingerprint(tmp_path)
    assert main(["run", RECIPE, "--output-dir", str(tmp_path / "out"), flag]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and len(err.strip().splitlines()) == 1, err
    assert not (run_dir / ".run.lock").exists()
    assert fingerprint(tmp_path) == before


ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


# --------------------------------------------------------------------------- 4. one run per dir


def test_rerun_into_an_existing_run_directory_is_refused(tmp_path):
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = cli_in_clean_home(tmp_path, "run", GRPO, "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2
    assert f"run directory {run_dir} already holds a run (metrics.jsonl)" in proc.stderr
    assert "pass --resume to continue it, --overwrite to delete it" in proc.stderr
    # Nothing launched; the run directory's lock (taken before deciding) is all that was added.
    assert sorted(p.name for p in run_dir.iterdir()) == [".run.lock", "metrics.jsonl"]


def test_resume_into_an_empty_directory_is_refused(tmp_path):
    proc = cli_in_clean_home(tmp_path, "run", GRPO, "--resume", "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2
    assert "holds no run to continue; drop --resume" in proc.stderr


def test_resume_and_overwrite_exclude_each_other(tmp_path):
    proc = cli_in_clean_home(tmp_path, "run", GRPO, "--resume", "--overwrite")
    assert proc.returncode == 2
    assert "not allowed with argument" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_overwrite_clears_the_old_run(tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "grpo_moe_tiny"
    # An old run's leftovers: 8 steps of JSONL, an event file, an offline W&B run, a picture.
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "tensorboard" / "events.out.tfevents.1.old").write_bytes(b"old")
    (run_dir / "wandb" / "offline-run-old").mkdir(parents=True)
    (run_dir / "expert_load_heatmap.png").write_bytes(b"old")
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(8)))
    proc = cli_in_clean_home(
        tmp_path, "run", GRPO, "training.max_steps=1", "--overwrite", "--output-dir", runs,
        timeout=380,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0]
    assert [p.name for p in (run_dir / "tensorboard").iterdir()] != []
    assert not (run_dir / "tensorboard" / "events.out.tfevents.1.old").exists()
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [p.name for p in (run_dir / "wandb").glob("offline-run-*")] != ["offline-run-old"]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert (run_dir / "expert_load_heatmap.png").stat().st_size > 10_000

"""A recipe's run opened by the process that logs it (launch/recipe_run.py): one run per
directory said in recipe terms."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


def test_the_per_rank_entrypoint_refuses_a_logged_run_in_recipe_terms(tmp_path):
    # torchrun -m nemo_moe_metrics.train (e.g. a Slurm rerun) checks before touching recipe.yaml.
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.launch.recipe_run import refuse_a_logged_run
    from nemo_moe_metrics.sinks import RunExistsError

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunExistsError, match="pass the override logger.resume=true to continue"):
        refuse_a_logged_run(tmp_path, load_recipe(GRPO))
    refuse_a_logged_run(tmp_path, load_recipe(GRPO, ["logger.resume=true"]))  # continues
    (tmp_path / "metrics.jsonl").write_text("")  # failed before logging: not a run
    refuse_a_logged_run(tmp_path, load_recipe(GRPO))


@pytest.mark.one_line
def test_a_requeued_job_continues_only_a_run_it_logged(tmp_path, monkeypatch):
    from nemo_moe_metrics.launch.recipe_run import requeued_run_resumes

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert requeued_run_resumes(run_dir) == []
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert requeued_run_resumes(run_dir) == []  # the first start logged nothing
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    assert requeued_run_resumes(run_dir) == ["logger.resume=true"]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert requeued_run_resumes(run_dir) == []

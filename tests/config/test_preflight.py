"""Preflight (config/preflight.py): the model, parallel layout, batches and data checked together
by check and run before any launch, through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_moe_metrics.config import preflight as _preflight
from tests.e2e.test_cli_ux import cli_in_clean_home

ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"

SFT = ROOT / "examples" / "configs" / "sft_moe_tiny.yaml"

MCFG = _preflight.MCFG  # the recipe's metric-flag block, "policy.<worker>_cfg"


# --------------------------------------------------------------------------- 8. check summary


def test_check_ends_with_the_layout_and_ok(tmp_path):
    proc = cli_in_clean_home(
        tmp_path, "check", GRPO, "--nproc", "4", "policy.train_micro_batch_size=4"
    )
    assert proc.returncode == 0, proc.stderr
    # 4 ranks, no pipeline/context split: data-parallel 4; 8 experts over expert-parallel 2;
    # the global batch of 16 is 4 sequences per rank, one microbatch of 4; 4 prompts x 4.
    assert proc.stdout.splitlines()[-7:] == [
        "layout on 4 rank(s):",
        "  data-parallel size: 4 (tensor 1 x pipeline 1 x context 1 x data 4)",
        "  experts per rank: 4 of 8 (expert-parallel 2, top-2)",
        "  sequences per step: 16 over all 4 data-parallel rank(s) (policy.train_global_batch_size,"
        " as in NeMo RL and Megatron), 4 per rank",
        "  microbatches per rank: 1 per step, 4 sequences each",
        "  rollouts per step: 4 prompts x 4 generations (NeMo RL's grpo.num_prompts_per_step x "
        "num_generations_per_prompt)",
        "OK: recipe 'grpo_moe_tiny' can run on 4 rank(s) (8 steps of grpo)",
    ]


@pytest.mark.parametrize(
    "nproc,overrides,needle",
    [
        # 16 over 2 ranks is 8 each: not a whole microbatch of 16.
        ("2", ["policy.train_micro_batch_size=16"], "multiple of data-parallel size 2 x "
         "policy.train_micro_batch_size=16: it counts the step's sequences over all 2 "
         "data-parallel ranks of --nproc 2 (as in NeMo RL and Megatron): each rank trains 16/2"),
        # 16 over 8 ranks is 2 each: not a whole group of 4 generations.
        ("8", ["policy.train_micro_batch_size=1"], "multiple of data-parallel size 8 x "
         "grpo.num_generations=4: each data-parallel rank samples whole groups of 4"),
    ],
)  # fmt: skip
def test_check_refuses_a_global_batch_the_data_parallel_ranks_cannot_split(
    tmp_path, nproc, overrides, needle
):
    proc = cli_in_clean_home(tmp_path, "check", GRPO, "--nproc", nproc, *overrides)
    assert proc.returncode == 2
    text = " ".join(proc.stderr.split())
    assert needle in text, text
    assert "set train_global_batch_size to a multiple of" in text


def test_check_of_a_dense_recipe_says_it_has_no_experts(tmp_path):
    proc = cli_in_clean_home(
        tmp_path,
        "check",
        SFT,
        "policy.model.num_experts=null",
        f"{MCFG}.expert_model_parallel_size=1",
        "--nproc",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "  experts per rank: none (a dense model)\n" in proc.stdout
    assert proc.stdout.rstrip().endswith(
        "OK: recipe 'sft_moe_tiny' can run on 1 rank(s) (8 steps of sft)"
    )


DPO = ROOT / "examples" / "configs" / "dpo_moe_tiny.yaml"

# --------------------------------------------------------------------------- 2. preflight


EXPERTS_7 = (
    "policy.model.num_experts=7 is not divisible by "
    "policy.megatron_cfg.expert_model_parallel_size=2"
)


@pytest.mark.one_line
def test_check_rejects_experts_not_divisible_by_expert_parallel(tmp_path):
    proc = cli_in_clean_home(tmp_path, "check", GRPO, "policy.model.num_experts=7")
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr
    assert "set num_experts to a multiple of 2 (e.g. 8)" in proc.stderr


@pytest.mark.one_line
def test_run_rejects_experts_not_divisible_before_any_launch(tmp_path):
    out = tmp_path / "runs"
    proc = cli_in_clean_home(
        tmp_path, "run", GRPO, "policy.model.num_experts=7", "--output-dir", out
    )
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr
    assert not out.exists(), "nothing was launched or written"


@pytest.mark.one_line
def test_check_rejects_a_world_size_that_does_not_fit_expert_parallel(tmp_path):
    proc = cli_in_clean_home(tmp_path, "check", GRPO, "--nproc", "3")
    assert proc.returncode == 2
    assert "--nproc 3 does not fit policy.megatron_cfg.expert_model_parallel_size=2" in proc.stderr
    assert "use --nproc 2" in proc.stderr


@pytest.mark.one_line
def test_check_rejects_pipeline_parallel_for_the_reference_worker(tmp_path):
    proc = cli_in_clean_home(
        tmp_path, "check", SFT, "policy.megatron_cfg.pipeline_model_parallel_size=2"
    )
    assert proc.returncode == 2
    assert "pipeline_model_parallel_size=2" in proc.stderr
    assert "set both to 1" in proc.stderr


@pytest.mark.one_line
def test_check_rejects_grpo_batch_without_whole_groups(tmp_path):
    proc = cli_in_clean_home(
        tmp_path,
        "check",
        GRPO,
        "policy.train_global_batch_size=6",
        "policy.train_micro_batch_size=2",
    )
    assert proc.returncode == 2
    text = " ".join(proc.stderr.split())
    # 6 over the 2 data-parallel ranks of the default --nproc 2: 3 each, no whole microbatch
    # of 2 nor group of 4; the smallest global batch that fits both is 2 x lcm(2, 4) = 8.
    assert "policy.train_global_batch_size=6 is not a multiple of data-parallel size 2 x" in text
    assert "a multiple of 8 (e.g. 8)" in text


@pytest.mark.one_line
def test_check_rejects_grpo_prompt_and_response_longer_than_seq_length(tmp_path):
    proc = cli_in_clean_home(tmp_path, "check", GRPO, "grpo.response_length=30")
    assert proc.returncode == 2
    assert (
        "grpo.prompt_length=8 + grpo.response_length=30 exceeds policy.model.seq_length=32"
        in proc.stderr
    )
    assert "raise seq_length to 38" in proc.stderr


@pytest.mark.one_line
def test_check_rejects_odd_dpo_batches(tmp_path):
    proc = cli_in_clean_home(
        tmp_path,
        "check",
        DPO,
        "policy.train_global_batch_size=3",
        "policy.train_micro_batch_size=1",
    )
    assert proc.returncode == 2
    assert "must both be even for DPO" in proc.stderr


@pytest.mark.one_line
def test_check_rejects_sft_min_length_above_seq_length(tmp_path):
    proc = cli_in_clean_home(tmp_path, "check", SFT, "training.min_seq_length=40")
    assert proc.returncode == 2
    assert "training.min_seq_length=40 must lie in [2, policy.model.seq_length=32]" in proc.stderr


@pytest.mark.one_line
def test_check_lists_every_problem_at_once(tmp_path):
    proc = cli_in_clean_home(
        tmp_path, "check", GRPO, "policy.model.num_experts=7", "grpo.response_length=30"
    )
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr and "exceeds policy.model.seq_length=32" in proc.stderr


@pytest.mark.one_line
def test_check_accepts_the_shipped_recipes_on_their_ranks(tmp_path):
    for recipe in (SFT, DPO, GRPO):
        proc = cli_in_clean_home(tmp_path, "check", recipe)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.one_line
def test_top_k_above_experts_names_the_override(tmp_path):
    proc = cli_in_clean_home(tmp_path, "check", GRPO, "policy.model.moe_router_topk=9")
    assert proc.returncode == 2
    assert "override 'policy.model.moe_router_topk=9': moe_router_topk=9 exceeds num_experts=8" in (
        proc.stderr
    )

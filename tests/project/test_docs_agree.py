"""A new user's first hour (issue 25): what the docs and the README say agrees with the code, the
commands they show run as written, and documented run commands in sequence do not collide."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_cli_ux import cli_in_clean_home

ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


# --------------------------------------------------------------------------- 9. docs agree


def test_suite_time_agrees_between_readme_and_versions():
    import re

    readme = (ROOT / "README.md").read_text()
    versions = (ROOT / "docs" / "en" / "versions.md").read_text()
    # "about 9 minutes" or "about 9 to 10 minutes"; the same figure on all three pages.
    pattern = r"test suite takes about (\d+(?: to \d+)?) minutes on 2 cores"
    in_readme = re.search(pattern, readme)
    in_versions = re.search(pattern, re.sub(r"\s+", " ", versions))
    assert in_readme and in_versions, "README and versions.md must both state the suite's time"
    assert in_readme[1] == in_versions[1]
    zh = (ROOT / "docs" / "zh" / "versions.md").read_text()
    assert f"约需 {in_readme[1].replace(' to ', ' 到 ')} 分钟" in zh


def test_top_level_help_mentions_hugging_face_models(tmp_path):
    proc = cli_in_clean_home(tmp_path, "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "for Megatron-core and Hugging Face models" in text


def test_troubleshooting_says_attach_takes_a_config_json_dict():
    from hf_tiny import tiny_config

    from nemo_moe_metrics.worker.policy_metrics import model_facts

    en = " ".join((ROOT / "docs" / "en" / "troubleshooting.md").read_text().split())
    assert "not a dict" not in en
    assert "its `config.json` as a dict holding `model_type`" in en
    zh = (ROOT / "docs" / "zh" / "troubleshooting.md").read_text()
    assert "而不是字典" not in zh
    # What the docs say is what attach does: a config.json dict is accepted.
    as_dict = {**tiny_config("qwen3_moe").to_dict(), "model_type": "qwen3_moe"}
    assert model_facts(as_dict).num_experts == 8


def test_train_global_batch_size_counts_all_data_parallel_ranks_as_in_nemo_rl():
    from nemo_moe_metrics.config import ConfigError, PolicyConfig, load_recipe

    text = PolicyConfig.model_fields["train_global_batch_size"].description
    assert "ALL data-parallel ranks" in text and "NeMo RL" in text and "used to" in text
    for recipe in sorted((ROOT / "examples" / "configs").glob("*.yaml")):
        body = recipe.read_text()
        assert "counts the step's sequences over ALL data-parallel ranks" in body, recipe.name
        assert "multiply an older" in body, recipe.name  # the note for the old meaning
    for lang, needle in (("en", "Changed: it used to count"), ("zh", "变更")):
        loops = " ".join((ROOT / "docs" / lang / "training_loops.md").read_text().split())
        assert needle in loops and "num_prompts_per_step" in loops, lang
    # A NeMo RL grpo section copied as is is refused with what each key is here.
    with pytest.raises(ConfigError, match="num_generations_per_prompt is grpo.num_generations"):
        load_recipe(GRPO, ["grpo.num_generations_per_prompt=4"])
    with pytest.raises(ConfigError, match="num_prompts_per_step x grpo.num_generations"):
        load_recipe(GRPO, ["grpo.num_prompts_per_step=4"])


# --------------------------------------------------------------------------- 10. README lines


def _readme_commands() -> list[str]:
    import re

    text = (ROOT / "README.md").read_text()
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", text, re.S) if "-m venv" in c]


def test_readme_312_line_finds_python312_from_pyenv_verbatim(tmp_path):
    import shutil

    line = next(c for c in _readme_commands() if ".venv312" in c)
    interpreter = line.split(" -m venv ")[0]  # the part that has to find Python 3.12
    if not shutil.which("pyenv") and not shutil.which("python3.12"):
        pytest.skip("neither pyenv nor python3.12 on this machine")
    proc = subprocess.run(
        f"{interpreter} -c 'import sys; print(sys.version_info[:2])'",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYENV_VERSION"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(3, 12)"


def test_readme_lines_use_their_own_venv_and_run_directory():
    import re

    from nemo_moe_metrics.config import load_recipe

    lines = [c for c in _readme_commands() if "nemo-moe-metrics run" in c]
    assert len(lines) == 2
    venvs = {re.search(r"-m venv (\S+)", c)[1] for c in lines}
    runs = {load_recipe(ROOT / re.search(r"run (\S+\.yaml)", c)[1]).name for c in lines}
    assert venvs == {".venv", ".venv312"}
    assert runs == {"grpo_moe_tiny", "grpo_hybrid_moe_tiny"}


# -------------------------------------------------------------------------- documented run commands


def _documented_runs() -> list[tuple[str, list[str]]]:
    import re
    import shlex

    sources = [*sorted((ROOT / "examples" / "configs").glob("*.yaml"))]
    sources += [ROOT / "docs" / lang / "routing_consistency.md" for lang in ("en", "zh")]
    runs = []
    for path in sources:
        for line in path.read_text(encoding="utf-8").splitlines():
            found = re.search(r"nemo-moe-metrics run (\S+\.yaml.*)$", line.lstrip("# "))
            if found:
                args = shlex.split(found.group(1))
                runs.append((f"{path.name}: {line.strip()}", args))
    return runs


def test_documented_run_commands_in_sequence_use_distinct_run_directories():
    """A recipe's documented second command (e.g. R3 without replay) is not refused because the
    first one's run already holds the directory."""
    from nemo_moe_metrics.launch import run_dir_for

    runs = _documented_runs()
    assert any("moe_enable_routing_replay=false" in where for where, _ in runs)
    by_source: dict[str, dict] = {}
    for where, args in runs:
        recipe, overrides = args[0], [a for a in args[1:] if "=" in a and not a.startswith("-")]
        run_dir = run_dir_for(ROOT / recipe, overrides, "runs")
        seen = by_source.setdefault(where.split(":")[0], {})
        assert seen.setdefault(run_dir, where) == where, f"{where} reuses {seen[run_dir]}'s run dir"

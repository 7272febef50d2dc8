"""The one way torchtitan is installed: the same line everywhere, and that line, run into a
fresh environment next to transformers, leaves transformers importable and its hub untouched.

The fresh environment is a virtual environment made here that sees this environment's packages
(torch, transformers, huggingface_hub, ...) through a .pth file, minus what the line installs,
so pip resolves the line against exactly what a user of ``[all]`` has, from the local package
index, in seconds. (triton, 700 MB and a dependency of torch itself, stays visible: the line's
``triton==3.7.1`` is then already satisfied, as it is with a CUDA torch wheel.)
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nemo_moe_metrics.runtime.extras import TORCHTITAN_INSTALL, install_hint

ROOT = Path(__file__).resolve().parents[2]
# Where a user reads (or CI runs) the torchtitan install, and the same line must be there.
SOURCES = [
    "README.md",
    "docs/en/torchtitan.md",
    "docs/zh/torchtitan.md",
    "examples/integrate_torchtitan.py",
    "pyproject.toml",
]
# What the line installs, by distribution (normalised) and by top-level import name.
INSTALLED = {"torchtitan", "spmd-types", "torch-checkpointing", "einops", "tyro", "triton"}
HIDDEN_PREFIXES = ("torchtitan", "spmd_types", "torch_checkpointing", "einops", "tyro")


def test_every_place_gives_the_same_torchtitan_install_line_and_there_is_no_extra():
    import tomllib

    assert install_hint("torchtitan") == TORCHTITAN_INSTALL
    for name in SOURCES:
        text = (ROOT / name).read_text(encoding="utf-8")
        assert TORCHTITAN_INSTALL in text, name
        assert "nemo_moe_metrics[torchtitan]" not in text, name
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "torchtitan" not in extras and not any("torchtitan" in r for r in extras["all"])
    # CI installs it the same way (its function takes the pip to use as "$1", quietly).
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    body = re.search(r'install_torchtitan\(\) \{.*?\n  ("\$1" .*?)\n\}', ci, re.S).group(1)
    words = body.replace('"$1"', "pip").replace("install -q", "install").replace("\\", " ")
    assert " ".join(words.split()) == TORCHTITAN_INSTALL
    named = {
        w.split("==")[0].lower().replace("_", "-") for w in TORCHTITAN_INSTALL.split() if "==" in w
    }
    assert named == INSTALLED


@pytest.mark.timeout(240)
def test_the_line_in_a_fresh_environment_keeps_transformers_importable(tmp_path):
    pytest.importorskip("transformers")
    env_dir, view = tmp_path / "env", tmp_path / "view"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    ours = Path(sysconfig.get_paths()["purelib"])
    view.mkdir()
    for entry in ours.iterdir():
        if not entry.name.lower().startswith(HIDDEN_PREFIXES):
            (view / entry.name).symlink_to(entry)
    # addsitedir also runs the view's own .pth files (the editable install of this project).
    (site / "_this_environment.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    probe = "import transformers, huggingface_hub; print(huggingface_hub.__version__)"
    hub = md.version("huggingface_hub")
    before = subprocess.run([str(python), "-c", probe + "; import torchtitan"], capture_output=True)
    assert before.returncode != 0 and b"No module named 'torchtitan'" in before.stderr

    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for command in TORCHTITAN_INSTALL.split(" && "):  # as the docs say, pip being this env's
        words = shlex.split(command)
        assert words[:2] == ["pip", "install"], command
        cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", *words[2:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    after = subprocess.run(
        [str(python), "-c", probe + "; import torchtitan.models.common.moe, tyro, einops"],
        capture_output=True,
        text=True,
    )
    assert after.returncode == 0, after.stderr[-2000:]
    assert after.stdout.strip() == hub  # transformers' hub was not downgraded
    added = {
        d.metadata["Name"].lower().replace("_", "-") for d in md.distributions(path=[str(site)])
    }
    assert added <= INSTALLED and {"torchtitan", "tyro"} <= added, added
    assert not {"huggingface-hub", "fsspec", "datasets"} & added

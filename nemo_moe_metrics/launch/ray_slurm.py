"""Ray on Slurm, the way NeMo RL users start it: a Ray head on the allocation's first node, a Ray
worker on every other node, then the driver on the first node (``recipes/ray_slurm.py``).

:func:`ray_sbatch_script` writes that job as one readable sbatch script (no containers: the
nodes run this checkout and this environment from a filesystem they share, as
``recipes/slurm.py`` without ``--container-image``). Each Ray node is one ``srun`` task
(``ray start ... --block`` in the background), so Slurm owns every Ray process and the job's
end stops them; the cluster's token is made in the job and lives only in its environment; the
driver (:mod:`.ray_driver`) writes the run directory and its output goes to the job's log
(``log-<name>_<job id>_<restart>.out``), where :func:`~.slurm_job.follow_job` looks.
:func:`submit_ray_job` submits it and records it for ``--follow``; a requeued job continues
its run (the driver reads ``SLURM_RESTART_COUNT``).

Container clusters (pyxis/enroot) use nemo-run's own Ray-on-Slurm template instead
(``nemo_run.run.ray``: ``RayCluster`` / ``RayJob`` with a ``SlurmExecutor``, every Ray process
in ``--container-name``): :func:`nemo_run_ray_dry_run` renders it for the same recipe.

``python -m nemo_moe_metrics.launch.ray_slurm wait-nodes N`` is the script's wait for its Ray
cluster: until ``RAY_ADDRESS`` answers with N nodes alive (or the timeout names what is up).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from nemo_moe_metrics.config import ConfigError, load_recipe
from nemo_moe_metrics.config.preflight import preflight, slurm_rank_words
from nemo_moe_metrics.launch.checks import check_resume_has_steps_left, claim_run_dir
from nemo_moe_metrics.launch.slurm_job import SlurmError, SubmittedJob
from nemo_moe_metrics.launch.slurm_submit import fold_shell_line
from nemo_moe_metrics.launch.supervise import SRC_ROOT

#: The script's name in the job's folder.
SCRIPT_NAME = "ray_job.sbatch"
RAY_PORT = 6379


def _per_node(gpus_per_node: int, ranks_per_node: int | None) -> int:
    per_node = ranks_per_node or gpus_per_node
    if per_node < 1:
        raise ConfigError(
            "--gpus-per-node 0 runs on CPU nodes: say how many ranks (Ray actors) each runs "
            "with --ranks-per-node N"
        )
    return per_node


def _driver_command(
    recipe_path: Path, overrides: list[str], world: int, output_root: Path, address: str
) -> list[str]:
    return [
        "python", "-m", "nemo_moe_metrics.launch.ray_driver", str(recipe_path), *overrides,
        "--nproc", str(world), "--output-dir", str(output_root), "--ray-address", address,
    ]  # fmt: skip


def ray_sbatch_script(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    *,
    account: str,
    partition: str,
    nodes: int = 2,
    gpus_per_node: int = 8,
    ranks_per_node: int | None = None,
    ray_port: int = RAY_PORT,
    time_limit: str = "01:00:00",
    job_files: str | Path = "slurm_jobs/ray/JOB",
    start_timeout_s: int = 300,
) -> str:
    """The sbatch script of a Ray job for the recipe on ``nodes`` nodes (one Ray node each).

    ``gpus_per_node`` GPUs per node (one rank each), or ``gpus_per_node=0`` and
    ``ranks_per_node`` CPU ranks per node (gloo). The recipe, the run directory root and
    ``job_files`` (the job's logs) are absolute paths on the shared filesystem.
    """
    recipe = load_recipe(recipe_path, overrides)
    per_node = _per_node(gpus_per_node, ranks_per_node)
    world = nodes * per_node
    preflight(recipe, world, slurm_rank_words(nodes, per_node, gpus_per_node == 0))
    files = Path(job_files).resolve()
    cpu = gpus_per_node == 0
    resources = f"--num-cpus={per_node} --num-gpus=0" if cpu else f"--num-gpus={gpus_per_node}"
    srun = "srun --overlap --nodes=1 --ntasks=1"
    driver = _driver_command(
        Path(recipe_path).resolve(),
        [*overrides, "engine=ray"],
        world,
        Path(output_dir).resolve(),
        "$RAY_ADDRESS",
    )
    log = f"{files}/log-{recipe.name}_${{SLURM_JOB_ID}}_${{SLURM_RESTART_COUNT:-0}}.out"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={recipe.name}",
        f"#SBATCH --account={account}",
        f"#SBATCH --partition={partition}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={per_node}"
        if cpu
        else f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={files}/sbatch_%x_%j.out",
        "#SBATCH --requeue",
        "# Ray on Slurm as NeMo RL's ray.sub starts it: a Ray head on the first node, a Ray",
        "# worker on every other node (one srun task each, in the background), then the driver",
        "# on the first node. Slurm owns every Ray process: the job's end stops them.",
        "set -uo pipefail",
        f"cd {shlex.quote(SRC_ROOT)}",
        f"export PATH={Path(sys.executable).parent}:$PATH",
        f"export PYTHONPATH={shlex.quote(SRC_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}",
        *(["export OMP_NUM_THREADS=1"] if cpu else []),
        "export WANDB_MODE=${WANDB_MODE:-offline}",
        "export RAY_USAGE_STATS_ENABLED=0",
        "# This job's own cluster token, in the environment of its processes only (not on disk).",
        "export RAY_AUTH_MODE=token",
        "export RAY_AUTH_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "head_node=${nodes[0]}",
        f"head_ip=$({srun} -w \"$head_node\" hostname --ip-address | awk '{{print $1}}')",
        f"export RAY_ADDRESS=$head_ip:{ray_port}",
        "ray_tasks=()",
        "trap 'kill \"${ray_tasks[@]}\" 2>/dev/null; wait' EXIT",
        f'{srun} -w "$head_node" ray start --head --node-ip-address="$head_ip" '
        f"--port={ray_port} {resources} --include-dashboard=false --disable-usage-stats "
        "--block &",
        "ray_tasks+=($!)",
        f"python -m nemo_moe_metrics.launch.ray_slurm wait-nodes 1 --timeout {start_timeout_s} "
        "|| exit 1",
        'for node in "${nodes[@]:1}"; do',
        f'  {srun} -w "$node" ray start --address="$RAY_ADDRESS" {resources} '
        "--disable-usage-stats --block &",
        "  ray_tasks+=($!)",
        "done",
        f"python -m nemo_moe_metrics.launch.ray_slurm wait-nodes {nodes} --timeout "
        f"{start_timeout_s} || exit 1",
        " ".join(shlex.quote(w) if not w.startswith("$") else w for w in driver) + f" > {log} 2>&1",
        "status=$?",
        'echo "job exited with code $status"',
        "exit $status",
    ]
    return "\n".join(lines) + "\n"


def ray_dry_run(
    recipe_path: str | Path, overrides: list[str], output_dir: str | Path, **kw: Any
) -> str:
    """The sbatch command and script :func:`submit_ray_job` would submit (nothing is written)."""
    job_files = Path(kw.pop("job_dir", "slurm_jobs")).resolve() / "ray" / "<name>_<time>"
    script = ray_sbatch_script(recipe_path, overrides, output_dir, job_files=job_files, **kw)
    body = "\n".join(fold_shell_line(line) for line in script.splitlines())
    return f"# submit with:\nsbatch --parsable $SBATCH_SCRIPT\n\n# SBATCH_SCRIPT:\n{body}\n"


def submit_ray_job(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    *,
    job_dir: str | Path = "slurm_jobs",
    resume: bool = False,
    overwrite: bool = False,
    **kw: Any,
) -> SubmittedJob:
    """Write the script into a new folder under ``job_dir/ray/``, submit it with sbatch and
    record the job (``job_dir/submitted/<id>.json``) for ``--follow``. The run directory is
    checked and prepared as for ``run`` first (one run per directory; ``resume`` continues it,
    ``overwrite`` deletes it)."""
    recipe = load_recipe(recipe_path, overrides)
    run_dir = Path(output_dir).resolve() / recipe.name
    claim_run_dir(run_dir, resume=resume, overwrite=overwrite, say=lambda _: None).release()
    if resume:
        check_resume_has_steps_left(run_dir, recipe, recipe_path)
        overrides = [*overrides, "logger.resume=true"]
    stamp = datetime.now().strftime("%Y%m%d_%H%M%S_%f")
    files = Path(job_dir).resolve() / "ray" / f"{recipe.name}_{stamp}"
    script = ray_sbatch_script(recipe_path, overrides, output_dir, job_files=files, **kw)
    files.mkdir(parents=True, exist_ok=True)
    (files / SCRIPT_NAME).write_text(script)
    metrics = run_dir / "metrics.jsonl"
    offset = metrics.stat().st_size if metrics.is_file() else 0
    proc = subprocess.run(
        ["sbatch", "--parsable", str(files / SCRIPT_NAME)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {(proc.stderr or proc.stdout).strip()}")
    nodes = kw.get("nodes", 2)
    record = SubmittedJob(
        job_id=proc.stdout.strip().split(";")[0],
        name=recipe.name,
        run_dir=str(run_dir),
        job_files=str(files),
        max_steps=recipe.training.max_steps,
        jsonl_offset=offset,
        nodes=nodes,
        ranks_per_node=_per_node(kw.get("gpus_per_node", 8), kw.get("ranks_per_node")),
        launcher="ray",
        algorithm=recipe.algorithm,
    )
    record.save(Path(job_dir).resolve())
    return record


def nemo_run_ray_dry_run(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    *,
    account: str,
    partition: str,
    container_image: str,
    nodes: int = 2,
    gpus_per_node: int = 8,
    time_limit: str = "01:00:00",
    job_dir: str | Path = "slurm_jobs",
) -> str:
    """nemo-run's Ray-on-Slurm sbatch script (``RayJob`` with a ``SlurmExecutor``: pyxis
    containers) that runs this recipe's driver once the cluster is up (nothing is written)."""
    import tempfile

    import nemo_run as run
    from nemo_run.run.ray.slurm import SlurmRayRequest

    recipe = load_recipe(recipe_path, overrides)
    world = nodes * _per_node(gpus_per_node, None)
    preflight(recipe, world, slurm_rank_words(nodes, gpus_per_node, False))
    output_root = Path(output_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="nemo_moe_metrics_rayjob_") as tmp:
        executor = run.SlurmExecutor(
            account=account,
            partition=partition,
            nodes=nodes,
            ntasks_per_node=1,
            gpus_per_node=gpus_per_node,
            time=time_limit,
            container_image=container_image,
            container_mounts=[f"{output_root}:{output_root}"],
            tunnel=run.LocalTunnel(job_dir=tmp),
        )
        executor.job_details.job_name = recipe.name
        # Inside the head container the driver joins the cluster nemo-run started there.
        command = _driver_command(
            Path(recipe_path), [*overrides, "engine=ray"], world, output_root, "auto"
        )
        text = SlurmRayRequest(
            name=recipe.name,
            cluster_dir=str(Path(job_dir).resolve() / "nemo_run_ray" / recipe.name),
            template_name="ray.sub.j2",
            executor=executor,
            command=" ".join(shlex.quote(w) for w in command),
            workdir="/nemo_run/code",
            launch_cmd=["sbatch", "--requeue", "--parsable"],
        ).materialize()
    return text.replace(tmp, "<job dir>")


def ray_cli() -> str:
    """The ``ray`` command of this environment (next to this interpreter), else the PATH's."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.is_file() else (shutil.which("ray") or "ray")


def active_nodes(
    address: str, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """``(nodes alive, what ray status said)`` of the cluster at ``address``: 0 while its GCS
    or its autoscaler state is not up yet. ``ray status`` reads it from the GCS alone (a
    driver's ``ray.init`` would also need this node's raylet, which may not be up). ``env``:
    the ``ray`` command's environment (default: this process's)."""
    try:
        proc = subprocess.run(
            [ray_cli(), "status", f"--address={address}"],
            capture_output=True, text=True, timeout=timeout_s, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return 0, f"ray status took over {timeout_s:g} s"
    said = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 or "Active:" not in proc.stdout:
        return 0, said.splitlines()[-1] if said else f"ray status exited {proc.returncode}"
    active = proc.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
    count = sum(
        1 for line in active.splitlines() if line.strip().split(" ")[-1].startswith("node_")
    )
    return count, f"{count} node(s) active"


def wait_nodes(count: int, timeout_s: float, address: str | None = None) -> int:
    """Wait until the Ray cluster at ``address`` (``RAY_ADDRESS``) has ``count`` nodes alive;
    0, or 1 with a line saying what is up."""
    address = address or os.environ.get("RAY_ADDRESS") or ""
    deadline = time.monotonic() + timeout_s
    said = "no answer"
    while time.monotonic() < deadline:
        alive, said = active_nodes(address, timeout_s=max(1.0, deadline - time.monotonic()))
        if alive >= count:
            print(f"Ray cluster at {address}: {alive} node(s) up", flush=True)
            return 0
        time.sleep(1.0)
    print(
        f"error: the Ray cluster at {address} did not have {count} node(s) within "
        f"{timeout_s:g} s ({said}); see the Ray nodes' output in the batch log",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    """``wait-nodes N [--timeout S]``."""
    parser = argparse.ArgumentParser(prog="python -m nemo_moe_metrics.launch.ray_slurm")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait-nodes", help="wait until RAY_ADDRESS has N nodes alive")
    wait.add_argument("count", type=int)
    wait.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    return wait_nodes(args.count, args.timeout)


if __name__ == "__main__":
    sys.exit(main())

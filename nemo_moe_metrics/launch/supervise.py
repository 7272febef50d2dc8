"""``nemo-moe-metrics run``: the console supervisor of one training job, and the launch
process's ownership of its children.

:func:`run_with_progress` checks and claims the run directory, starts the launch process
(``python -m nemo_moe_metrics.launch``) in a session of its own, shows a progress bar fed by
``metrics.jsonl``, watches the job's processes (:mod:`.job_watch`), stops the whole job on
Ctrl-C, SIGTERM or SIGHUP, and prints the summary or the failure. :func:`own_children` is the
launch process's side: it stops torchrun and the ranks on those signals, and dies with ``run``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_moe_metrics.config import ConfigError, Recipe, load_recipe
from nemo_moe_metrics.config.preflight import preflight
from nemo_moe_metrics.launch.checks import (
    check_launch_extras,
    check_resume_has_steps_left,
    claim_run_dir,
)
from nemo_moe_metrics.launch.failure_report import failure_report
from nemo_moe_metrics.launch.failures import (
    LAST_WORDS_ENV,
)
from nemo_moe_metrics.launch.job_watch import JobWatch
from nemo_moe_metrics.launch.progress import (
    GRPO_LOSS_NOTE,
    console_say,
    describe_step,
    make_console,
    read_new_lines,
    say,
)
from nemo_moe_metrics.launch.ray_cluster import ADDRESS_ENV, check_embedded
from nemo_moe_metrics.report import ReportError, render_report
from nemo_moe_metrics.run_dir.lock import TOKEN_ENV
from nemo_moe_metrics.run_dir.names import LAUNCH_LOG
from nemo_moe_metrics.run_dir.resume import ResumeError, prepare_resume, read_resume_state
from nemo_moe_metrics.runtime import processes
from nemo_moe_metrics.sinks.alerts import AlertConsole

#: Where this package's source tree is: the children import the package from it too (an
#: editable install or a source checkout).
SRC_ROOT = str(Path(__file__).resolve().parents[2])


def own_children() -> None:
    """This launch process stops its job (torchrun and the ranks, each in a session of their
    own) on SIGTERM, SIGINT or SIGHUP, and gets SIGTERM when ``nemo-moe-metrics run`` that
    started it dies (even by SIGKILL)."""
    launcher = os.environ.get(processes.LAUNCHER_ENV)
    if launcher:
        processes.die_with_parent(int(launcher.partition(":")[0]))

    stopping: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if stopping:  # already stopping (a second signal): that one finishes the job
            return
        stopping.append(signum)
        name = signal.Signals(signum).name
        print(f"launcher: {name}: stopping torchrun and the ranks", file=sys.stderr, flush=True)
        processes.stop_descendants(grace_s=10.0)
        os._exit(processes.Interrupted(signum).exit_status)

    for sig in processes.SIGNAL_EXIT:
        signal.signal(sig, stop)


#: Seconds between two looks at the job's processes for stopped ones (job_watch.py).
WATCH_EVERY_S = 2.0


def run_with_progress(
    recipe_path: str | Path,
    overrides: list[str],
    nproc: int,
    output_dir: str | Path,
    console: Any | None = None,
    poll_s: float = 0.5,
    *,
    resume: bool = False,
    overwrite: bool = False,
    engine: str | None = None,
    ray_address: str | None = None,
) -> int:
    """Launch the recipe in a child process and show a rich progress bar fed by its JSONL.

    ``engine`` (default: the recipe's ``engine``): ``torchrun`` launches the ranks through
    nemo-run; ``ray`` starts the Ray driver (:mod:`.ray_driver`: an embedded local Ray, or the
    cluster at ``ray_address`` / ``RAY_ADDRESS``), whose actors are the ranks.

    Before anything starts: the recipe, its layout on ``nproc`` ranks (:mod:`.preflight`), the
    extras it needs and the run directory (one run per directory, see :func:`prepare_run_dir`)
    are checked, and the directory's lock is taken (:class:`~.run_dir.RunDirLock`: a second
    run on a live directory is refused naming its holder). This process owns the job it starts
    (:mod:`.processes`): Ctrl-C, SIGTERM or SIGHUP stop torchrun and every rank and return
    128 + the signal (130 for Ctrl-C) after one line; ``kill -9`` of it stops them too. Returns
    the launcher's exit status; its own output goes to ``<run>/launch.log``; on failure the
    failing rank's first error is printed.
    """
    if engine is not None:
        overrides = [*overrides, f"engine={engine}"]
    recipe = load_recipe(recipe_path, overrides)  # fail fast, before any process starts
    if ray_address and recipe.engine != "ray":
        raise ConfigError(
            f"--ray-address {ray_address} names a Ray cluster, but the engine is "
            f"{recipe.engine}: add --engine ray (or engine: ray in the recipe)"
        )
    preflight(recipe, nproc)
    check_launch_extras(recipe)
    if recipe.engine == "ray" and not (ray_address or os.environ.get(ADDRESS_ENV)):
        check_embedded(nproc)  # what an embedded local Ray would hold, before it starts
    console = make_console(console)
    run_dir = Path(output_dir).resolve() / recipe.name
    with claim_run_dir(
        run_dir, resume=resume, overwrite=overwrite, say=console_say(console)
    ) as lock:
        if resume:
            _prepare_resume(run_dir, recipe, recipe_path, console)
            overrides = [*overrides, "logger.resume=true"]
        where = ["--nproc", str(nproc), "--output-dir", str(Path(output_dir).resolve())]
        module = "nemo_moe_metrics.launch"
        if recipe.engine == "ray":  # the driver runs the loop; its Ray actors are the ranks
            module = "nemo_moe_metrics.launch.ray_driver"
            where += ["--ray-address", ray_address] if ray_address else []
        cmd = [sys.executable, "-m", module, str(recipe_path), *where]
        with tempfile.TemporaryDirectory(prefix="nemo_moe_metrics_run_") as tmp:
            job = _Job(cmd + overrides, run_dir, recipe, _child_env(lock.token), resume)
            job.env[LAST_WORDS_ENV] = job.last_words = str(Path(tmp) / "rank_errors.jsonl")
            status = job.supervise(console, poll_s)
            if status is not None:  # interrupted: the whole job is stopped
                user = [o for o in overrides if o not in ("logger.resume=true", f"engine={engine}")]
                how = ["--engine", engine] if engine else []
                again = [
                    "nemo-moe-metrics",
                    "run",
                    str(recipe_path),
                    *user,
                    *where,
                    *how,
                    "--resume",
                ]
                say(console, job.interrupted_line(status, shlex.join(again)))
                return status
            return job.finish(console)


def _prepare_resume(run_dir: Path, recipe: Recipe, recipe_path: str | Path, console: Any) -> None:
    """Make the records agree (what was cut and why is printed), then check steps are left."""
    try:
        _, notes = prepare_resume(run_dir, table_every=recipe.logger.table_every)
    except ResumeError as err:
        raise ConfigError(str(err)) from None
    for note in notes:
        say(console, f"resume: {note}")
    check_resume_has_steps_left(run_dir, recipe, recipe_path)


def _child_env(token: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_ROOT, env.get("PYTHONPATH")) if p)
    # The ranks end when this process does (processes.watch_launcher); rank 0 joins the lock.
    env[processes.LAUNCHER_ENV] = processes.identity()
    env[TOKEN_ENV] = token
    return env


@dataclass
class _Job:
    """The launch process ``run`` starts and watches, and what it printed."""

    cmd: list[str]
    run_dir: Path
    recipe: Recipe
    env: dict[str, str]
    resume: bool
    returncode: int | None = None
    started: float = 0.0
    last: dict[str, Any] | None = None
    stopped: int = 0  # processes stopped after a signal
    last_words: str | None = None  # where the ranks record their errors (failures.py)
    alerts: Any = None  # sinks.alerts.AlertConsole: the alert lines rank 0 recorded, on the console
    watch: JobWatch | None = None  # stopped ranks and launchers (job_watch.py)
    gave_up: str | None = None  # why run stopped a job whose launcher stopped answering

    def _alert_console(self) -> Any:
        if self.alerts is None:
            self.alerts = AlertConsole(per_step=self.recipe.logger.alerts.max_lines_per_step)
        return self.alerts

    def supervise(self, console: Any, poll_s: float) -> int | None:
        """Run the launch process with a progress bar until it ends: None, or the exit status
        of a stopping signal after the whole job was stopped."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.table import Column

        metrics_path = self.run_dir / "metrics.jsonl"
        # Show this run's steps only: a resumed run appends to the file it continues.
        offset = metrics_path.stat().st_size if metrics_path.is_file() else 0
        self.started = time.time()
        if self.recipe.algorithm == "grpo":
            say(console, GRPO_LOSS_NOTE)
        processes.become_subreaper()  # orphans of the job stay findable (and stoppable) here
        columns = (
            TextColumn("[bold]{task.fields[name]}"),
            BarColumn(),
            # Piped output is 80 columns: the bar and the metrics give way, never the counts
            # or the elapsed time (which rich would otherwise cut to "0:0…").
            MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=3)),
            TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
            TextColumn(
                "{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis")
            ),
        )
        try:
            with (
                processes.signals_raise(),
                (self.run_dir / LAUNCH_LOG).open("a" if self.resume else "w") as log,
                Progress(*columns, console=console) as progress,
            ):
                task = progress.add_task(
                    "starting ranks...", total=self.recipe.training.max_steps, name=self.recipe.name
                )
                proc = subprocess.Popen(
                    self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                    start_new_session=True,  # a terminal's Ctrl-C comes here; we stop the job
                )  # fmt: skip
                self.watch = JobWatch(proc.pid)
                next_look = time.monotonic() + WATCH_EVERY_S
                while True:
                    done = proc.poll() is not None
                    if not done and time.monotonic() >= next_look:
                        next_look = time.monotonic() + WATCH_EVERY_S
                        lines, self.gave_up = self.watch.look()
                        for line in lines:
                            say(progress.console, line)
                        if self.gave_up:
                            processes.stop_descendants(grace_s=5.0)
                            proc.wait()
                            break
                    rows, offset = read_new_lines(metrics_path, offset)
                    for row in rows:  # alerts rank 0 recorded with the step (moe/alerts.py)
                        for line in self._alert_console().lines(row):
                            say(progress.console, line)
                    if rows:
                        self.last = rows[-1]
                        progress.update(
                            task,
                            completed=self.last["step"] + 1,
                            description=describe_step(self.last, self.recipe.algorithm),
                        )
                    if done:
                        break
                    time.sleep(poll_s)
        except (processes.Interrupted, KeyboardInterrupt) as stop:
            signum = stop.signum if isinstance(stop, processes.Interrupted) else signal.SIGINT
            with processes.signals_counted() as again:  # a second Ctrl-C: SIGKILL at once
                self.stopped = processes.stop_descendants(grace_s=10.0, force=again)
            return processes.Interrupted(signum).exit_status
        self.returncode = proc.returncode
        _stop_stragglers(ok=proc.returncode == 0)
        return None

    def interrupted_line(self, status: int, again: str) -> str:
        """The one line a stopped run prints."""
        name = next((s.name for s, code in processes.SIGNAL_EXIT.items() if code == status), "")
        last = read_resume_state(self.run_dir).last_step
        kept = "no step was logged yet" if last is None else f"it keeps every step up to {last}"
        parts = (
            "driver, Ray, actors" if self.recipe.engine == "ray" else "launcher, torchrun, ranks"
        )
        return (
            f"interrupted ({name or f'exit {status}'}): stopped the training job "
            f"({self.stopped} process(es): {parts}); "
            f"{self.run_dir}: {kept}; continue it with: {again}"
        )

    def finish(self, console: Any) -> int:
        """Print the failure, or the summary of a run that succeeded; the exit status."""
        assert self.returncode is not None
        if self.gave_up:
            say(console, f"run failed: {self.gave_up}; continue it with --resume")
            return 1
        if self.returncode != 0:
            words = Path(self.last_words) if self.last_words else None
            stopped = self.watch.failure_lines() if self.watch else []
            report = failure_report(self.run_dir, self.returncode, self.started, words, stopped)
            say(console, report)
            return self.returncode
        held = self._alert_console().closing_line(f"nemo-moe-metrics report {self.run_dir}")
        if held:
            say(console, held)
        last = (self.last or {}).get("step")
        console.print(f"[green]done[/green]: {self.run_dir}  (last step {last})", soft_wrap=True)
        if (self.run_dir / "metrics.jsonl").is_file():
            # The pictures and the summary a user looks at first (without the 'report' extra
            # the summary alone, with a line naming the extra).
            try:
                say(console, render_report(self.run_dir))
            except ReportError as err:  # the training itself succeeded: say why, exit 0
                say(console, f"report skipped: {err}")
        return 0


def _stop_stragglers(ok: bool) -> None:
    """Processes of the job still running after the launch process ended (torchrun or a rank
    left behind when it crashed; W&B's service finishing): given time after a success, then
    stopped."""
    deadline = time.monotonic() + (30.0 if ok else 2.0)
    while processes.descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    processes.stop_descendants(grace_s=5.0)

#!/usr/bin/env python
"""Kill a real training job at random points, resume it, and count lost and duplicated steps.

    python benchmarks/fault_injection.py --rounds 12                # the slow mode, N >= 10
    python benchmarks/fault_injection.py --rounds 12 --seed 7 --json faults.json
    python benchmarks/fault_injection.py --rounds 3 --faults kill-run,kill-rank,sigint

Each round starts ``nemo-moe-metrics run`` on the tiny SFT recipe (2 torchrun ranks; the first
round fresh, later ones with ``--resume``), waits a random time (from 0 s, during start-up, to
a few steps in) and injects one fault, as a user's cluster would:

- ``sigint``: Ctrl-C, to the run's process group as a terminal sends it (exit 130 expected);
- ``sigterm``: SIGTERM to ``run`` (exit 143 expected), as ``scancel`` or ``kill`` sends it;
- ``kill-run``: SIGKILL to ``run`` alone: the launcher's children must stop by themselves;
- ``kill-rank``: SIGKILL to one rank (the OOM killer): the run must fail naming that rank;
- ``kill-all``: SIGKILL to every process of the job at once (a lost node, a cgroup OOM kill);
- ``stop-rank``: SIGSTOP to one rank (a hung rank; Ctrl-Z of its process), then SIGCONT and
  Ctrl-C: the run must have named the stopped rank while it waited (exit 130);
- ``kill-torchrun``: SIGKILL to torchrun (the launcher of the ranks): the run must fail saying
  torchrun ended before its ranks, with the ranks' last words from torchelastic's log;
- ``stop-launcher``: SIGSTOP to torchrun: the run must give up on it after its timeout
  (``NEMO_MOE_METRICS_LAUNCHER_TIMEOUT_S``, 4 s here), stop the job and say why (exit 1);
- ``disk-full`` (``--disk-full``, root: the run directory is a small tmpfs): a ballast file
  fills the file system; the run must fail naming the file it could not write; the ballast
  is removed before the next round.

Two checks run once, apart from the rounds: ``--io-error`` (root: an ext4 file system on a
loop device that starts failing writes, :class:`FailingDisk`) checks that JSONL, TensorBoard
and ``run.json`` keep every step logged before a real disk I/O error; ``--hostile-names``
checks that recipe names that would leave ``--output-dir`` (``..``, ``/abs``, ``""``) are
refused by ``check`` and ``run`` with nothing written, and that a user's own file in the run
directory survives ``run`` and ``run --overwrite``; ``--hostile-inputs`` runs issue 52's
cases (``benchmarks/hostile_inputs.py``: outputs ``placement`` and ``ingest`` do not own,
sizes and counts that used to cost gigabytes or wrap, one-line input errors), each through the
real CLI with the user's files checked byte for byte and the bounded cases' peak memory.

After each fault no process of the job may be left (checked by pid, within 15 s). After the
last round a final ``--resume`` trains to ``training.max_steps``; then every step must be in
``metrics.jsonl``, the expert-load store and TensorBoard exactly once: the report gives the
lost and duplicated steps of each (0 and 0 expected) and each round's fault, exit status and
whether what it printed met the expectation. Exits 1 when a step is lost or duplicated or an
expectation failed. About 40 s a round on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir():
    sys.path.insert(0, str(_REPO))

from nemo_moe_metrics.runtime import processes  # noqa: E402

RECIPE = _REPO / "examples" / "configs" / "sft_moe_tiny.yaml"
NAME = "sft_moe_tiny"
# W&B off: it cannot be read back step by step offline; every other sink is on.
OVERRIDES = ["logger.wandb_enabled=false", "logger.table_every=1"]
FAULTS = (
    "sigint",
    "sigterm",
    "kill-run",
    "kill-rank",
    "kill-all",
    "stop-rank",
    "kill-torchrun",
    "stop-launcher",
)
#: The launcher timeout of the jobs started here (stop-launcher waits for it).
LAUNCHER_TIMEOUT_S = 4


@dataclass
class Round:
    """One fault: what was done, when, and what the run said."""

    fault: str
    logged_before: int  # complete JSONL lines when the fault was injected
    delay_s: float
    exit_status: int | None = None
    stopped_s: float | None = None  # until no process of the job was left
    left: list[int] = field(default_factory=list)  # processes still there after 15 s
    expectation_met: bool = True
    said: str = ""  # the run's last output lines


class Job:
    """One ``nemo-moe-metrics run`` in a session of its own, as a terminal would start it."""

    def __init__(self, out: Path, max_steps: int, *, resume: bool, extra: list[str] = ()):
        cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(RECIPE)]
        cmd += [f"training.max_steps={max_steps}", *OVERRIDES, *extra, "--output-dir", str(out)]
        if resume:
            cmd.append("--resume")
        env = {**os.environ, "PYTHONPATH": str(_REPO), "COLUMNS": "160"}
        env["NEMO_MOE_METRICS_LAUNCHER_TIMEOUT_S"] = str(LAUNCHER_TIMEOUT_S)
        env.setdefault("HOME", str(out.parent))
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=_REPO,
            start_new_session=True,
        )
        self.seen: set[int] = set()
        self.identity = processes.identity(self.proc.pid)

    def pids(self) -> list[int]:
        """The run and every process below it now (remembered: a killed parent orphans them)."""
        found = [self.proc.pid, *processes.descendants(self.proc.pid)]
        self.seen.update(found)
        return found

    def ranks(self) -> list[int]:
        """The pids of the rank processes, in rank order."""
        ranks = []
        for pid in self.pids():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"nemo_moe_metrics.train" in cmdline:
                rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
                if rank is not None:
                    ranks.append((int(rank), pid))
        return [pid for _, pid in sorted(ranks)]

    def torchrun(self) -> int | None:
        """The pid of torchrun (the launcher of the ranks), None before it started."""
        for pid in self.pids():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"torchrun" in cmdline or b"torch.distributed.run" in cmdline:
                    return pid
        return None

    def output(self, timeout: float = 300.0) -> tuple[int, str]:
        """Wait for the run to end: its exit status and everything it printed."""
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def marked(self) -> list[int]:
        """Every process that inherited this run's launcher mark (its children's children too,
        orphans included): what must be gone once the run is."""
        mark = f"{processes.LAUNCHER_ENV}={self.identity}".encode()
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError):
                    if mark in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                        found.append(int(name))
        return found

    def wait_gone(self, timeout: float = 15.0) -> tuple[float, list[int]]:
        """Seconds until no process the job ever had is running; the ones left after that."""
        start = time.monotonic()
        while True:
            left = [pid for pid in {*self.seen, *self.marked()} if processes.is_alive(pid)]
            if not left or time.monotonic() - start > timeout:
                return time.monotonic() - start, left
            time.sleep(0.05)


def logged(run_dir: Path) -> list[int]:
    """Steps of the complete lines of ``metrics.jsonl`` (torn ones skipped)."""
    path = run_dir / "metrics.jsonl"
    steps = []
    with contextlib.suppress(OSError):
        for line in path.read_bytes().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                steps.append(int(json.loads(line)["step"]))
    return steps


def wait_for_steps(job: Job, run_dir: Path, count: int, timeout: float = 240.0) -> int:
    """Wait until ``metrics.jsonl`` holds ``count`` complete lines (or the run ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        job.pids()
        n = len(logged(run_dir))
        if n >= count:
            return n
        time.sleep(0.1)
    return len(logged(run_dir))


def inject(job: Job, fault: str, rng: random.Random) -> str:
    """Do what the fault names to the running job; returns the fault done (``kill-rank``
    before any rank started becomes ``kill-all``)."""
    job.pids()
    if fault == "sigint":
        os.killpg(job.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    elif fault == "sigterm":
        os.kill(job.proc.pid, signal.SIGTERM)
    elif fault == "kill-run":
        os.kill(job.proc.pid, signal.SIGKILL)
    elif fault == "kill-rank":
        ranks = job.ranks()
        if not ranks:  # not started yet: the fault becomes a kill of the whole job
            fault = "kill-all"
        else:
            os.kill(ranks[rng.randrange(len(ranks))], signal.SIGKILL)
    elif fault == "stop-rank":
        ranks = job.ranks()
        if not ranks:
            fault = "kill-all"
        else:
            rank = ranks[rng.randrange(len(ranks))]
            os.kill(rank, signal.SIGSTOP)
            time.sleep(8.0)  # run looks every 2 s and names a rank stopped for 5 s
            os.kill(rank, signal.SIGCONT)
            os.killpg(job.proc.pid, signal.SIGINT)
    elif fault in ("kill-torchrun", "stop-launcher"):
        torchrun = job.torchrun() if job.ranks() else None
        if torchrun is None:
            fault = "kill-all"
        else:
            os.kill(torchrun, signal.SIGKILL if fault == "kill-torchrun" else signal.SIGSTOP)
    if fault == "kill-all":
        for pid in job.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return fault


def expectation(fault: str, status: int, said: str) -> bool:
    """Whether the run's exit status and last words match the fault it got."""
    if "Traceback" in said:
        return False
    if fault == "sigint":
        return status == 130 and "interrupted (SIGINT)" in said
    if fault == "sigterm":
        return status == 143 and "interrupted (SIGTERM)" in said
    if fault == "kill-rank":
        return status != 0 and ("was killed by SIGKILL" in said or "run failed" in said)
    if fault == "disk-full":
        return status != 0 and ("No space left on device" in said or "is full" in said)
    if fault == "stop-rank":
        return status == 130 and "is stopped (SIGSTOP" in said
    if fault == "kill-torchrun":
        return status != 0 and "torchrun, which started and watched the ranks, ended" in said
    if fault == "stop-launcher":
        return status == 1 and "was stopped (SIGSTOP) and answered nothing" in said
    return status == -signal.SIGKILL  # kill-run, kill-all: nothing is printed


def sink_steps(run_dir: Path) -> dict[str, list[int]]:
    """Every logged step as each sink holds it: raw JSONL lines, raw store records, and
    TensorBoard's scalar events as TensorBoard reads them (events a resume hid are hidden)."""
    from nemo_moe_metrics.sinks.store import scan_store, store_path

    with store_path(run_dir).open("rb") as f:
        stored = scan_store(f).steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = [e.step for e in acc.Scalars("train_perf/total_tokens")]
    return {"metrics.jsonl": logged(run_dir), "expert_loads.bin": stored, "tensorboard": tb}


def lost_and_duplicated(steps: list[int], max_steps: int) -> dict[str, list[int]]:
    """Steps of ``0 .. max_steps - 1`` missing from ``steps``, and steps in it more than once."""
    counts = collections.Counter(steps)
    return {
        "lost": [s for s in range(max_steps) if counts[s] == 0],
        "duplicated": sorted(s for s, n in counts.items() if n > 1),
    }


def fill_disk(directory: Path) -> Path:
    """A ballast file that leaves no free byte on ``directory``'s file system."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for block in (1 << 20, 4096, 1):  # unbuffered: the last bytes go in too
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * block)
    finally:
        os.close(fd)
    return ballast


@contextlib.contextmanager
def small_filesystem(size_mb: int) -> Any:
    """A tmpfs of ``size_mb`` MB mounted on a temporary folder (root only); yields the folder,
    or None where mounting is not allowed."""
    where = Path(tempfile.mkdtemp(prefix="nmm_small_fs_"))
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


class FailingDisk:
    """An ext4 file system on a loop device whose backing file lies, sparse, on a small tmpfs:
    :meth:`fail` fills that tmpfs, so every later write of a new block is a real I/O error of
    the device (``Buffer I/O error on device loopN``), as a failing disk gives. :meth:`reread`
    unmounts (what was not on the device is gone, as after a crash), frees the tmpfs and mounts
    the file system again, read-only, to see what survived."""

    def __init__(self, size_mb: int = 48) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="nmm_io_error_"))
        self.backing = self.root / "backing"
        self.mount = self.root / "fs"
        self.backing.mkdir()
        self.mount.mkdir()
        self.device = ""
        self._size_mb = size_mb

    def start(self) -> bool:
        """Mount it (root only); False where this machine cannot."""
        if os.geteuid() != 0 or not shutil.which("losetup") or not shutil.which("mkfs.ext4"):
            return False
        size = f"size={self._size_mb + 8}m"
        if not _ok("mount", "-t", "tmpfs", "-o", size, "tmpfs", str(self.backing)):
            return False
        image = self.backing / "disk.img"
        with image.open("wb") as f:
            f.truncate(self._size_mb << 20)
        found = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True)
        self.device = found.stdout.decode().strip()
        return (
            found.returncode == 0
            and _ok("mkfs.ext4", "-q", "-F", self.device)
            and _ok("mount", "-o", "errors=remount-ro", self.device, str(self.mount))
        )

    def fail(self) -> None:
        """From now on every write of a new block to the device fails."""
        fill_disk(self.backing)

    def reread(self) -> None:
        """Unmount (unwritten data is lost), free the device's space, mount it read-only."""
        subprocess.run(["umount", str(self.mount)], capture_output=True)
        with contextlib.suppress(OSError):
            (self.backing / "ballast").unlink()
        if not _ok("mount", "-o", "ro", self.device, str(self.mount)):
            raise RuntimeError(f"cannot mount {self.device} again on {self.mount}")

    def close(self) -> None:
        """Unmount and detach everything."""
        subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        if self.device:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
        subprocess.run(["umount", "-l", str(self.backing)], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _ok(*command: str) -> bool:
    return subprocess.run(list(command), capture_output=True).returncode == 0


@contextlib.contextmanager
def failing_disk(size_mb: int = 48) -> Any:
    """A :class:`FailingDisk`, mounted; None where this machine cannot mount one."""
    disk = FailingDisk(size_mb)
    try:
        yield disk if disk.start() else None
    finally:
        disk.close()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(_REPO), "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
    )  # fmt: skip


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def check_hostile_names(root: Path) -> dict[str, bool]:
    """Names that would leave ``--output-dir`` refused by ``check`` and ``run`` with nothing
    written; a user's file in the run directory kept by ``run`` and ``run --overwrite``."""
    out = root / "project" / "out"
    (out / NAME).mkdir(parents=True)
    (root / "project" / "README.md").write_text("the user's project\n")
    (out / NAME / "notes.txt").write_text("keep\n")
    before = _tree(root)
    result = {}
    for name in ("..", ".", '""', "/abs/dir", "a/b"):
        codes = [
            _cli(cmd, str(RECIPE), f"name={name}", *extra, cwd=root).returncode
            for cmd, extra in (("check", []), ("run", ["--output-dir", str(out), "--overwrite"]))
        ]
        result[f"name={name}"] = codes == [2, 2] and _tree(root) == before
    for flags in ([], ["--overwrite"]):
        proc = _cli("run", str(RECIPE), *flags, "--output-dir", str(out), cwd=root)
        ok = proc.returncode == 2 and "holds files that no run wrote" in proc.stderr
        result[f"notes.txt kept by run {' '.join(flags)}".strip()] = ok and _tree(root) == before
    return result


def check_io_error() -> dict[str, Any] | None:
    """Steps logged before a real disk I/O error, as each sink keeps them (None without
    root or loop devices)."""
    from nemo_moe_metrics.config import LoggerConfig
    from nemo_moe_metrics.sinks import build_sinks
    from nemo_moe_metrics.sinks.tensorboard import logged_steps

    with failing_disk() as disk:
        if disk is None:
            return None
        run_dir = disk.mount / "run"
        cfg = LoggerConfig(tensorboard_enabled=True, wandb_enabled=False)
        sink = build_sinks(cfg, run_dir, run_name="io_error")
        step = 0
        for step in range(40):
            if step == 5:
                disk.fail()
            try:
                sink.log({"train/loss": 1.0, "train_perf/tokens": 8.0}, step)
            except OSError:
                break
        disk.reread()
        kept = {
            "metrics.jsonl": logged(run_dir),
            "tensorboard": sorted(set(logged_steps(run_dir / "tensorboard", limit=10_000))),
            "run.json": (run_dir / "run.json").stat().st_size > 0,
        }
        return {"failed_at_step": step, "kept": kept}


def run_round(out: Path, fault: str, rng: random.Random, max_steps: int) -> Round:
    """Start (or resume) the run, inject ``fault`` at a random point, check what followed."""
    run_dir = out / NAME
    before = len(logged(run_dir))
    job = Job(out, max_steps, resume=before > 0)
    # From start-up (before any step) to a few steps in.
    wait_for_steps(job, run_dir, before + rng.choice([0, 1, 2, 3]))
    delay = rng.uniform(0.0, 1.5)
    time.sleep(delay)
    at_fault = len(logged(run_dir))
    ballast = None
    if fault == "disk-full":
        ballast = fill_disk(out)
    else:
        fault = inject(job, fault, rng)
    status, said = job.output()
    stopped_s, left = job.wait_gone()
    if ballast is not None:
        ballast.unlink()
    tail = "\n".join(said.strip().splitlines()[-6:])
    return Round(
        fault=fault,
        logged_before=at_fault,
        delay_s=delay,
        exit_status=status,
        stopped_s=stopped_s,
        left=left,
        expectation_met=expectation(fault, status, said) and not left,
        said=tail,
    )


def run_faults(out: Path, faults: list[str], seed: int, max_steps: int) -> dict[str, Any]:
    """The rounds, the final resume, and the lost/duplicated count of every sink."""
    rng = random.Random(seed)
    rounds = [run_round(out, fault, rng, max_steps) for fault in faults]
    status, said = 0, "(every step was logged before the last fault)"
    if len(set(logged(out / NAME))) < max_steps:
        status, said = Job(out, max_steps, resume=bool(logged(out / NAME))).output()
    steps = sink_steps(out / NAME)
    result = {sink: lost_and_duplicated(s, max_steps) for sink, s in steps.items()}
    return {
        "rounds": [asdict(r) for r in rounds],
        "final_exit_status": status,
        "final_said": "\n".join(said.strip().splitlines()[-3:]),
        "sinks": result,
        "lost": sum(len(r["lost"]) for r in result.values()),
        "duplicated": sum(len(r["duplicated"]) for r in result.values()),
        "expectations_met": all(r.expectation_met for r in rounds) and status == 0,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print the report, optionally write it as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="faults to inject (default 12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", help=f"comma-separated, in order (default: random of {FAULTS})")
    parser.add_argument("--disk-full", action="store_true", help="add disk-full rounds (root)")
    parser.add_argument(
        "--io-error", action="store_true", help="also check the sinks on a failing disk (root)"
    )
    parser.add_argument(
        "--hostile-names", action="store_true", help="also check names that leave --output-dir"
    )
    parser.add_argument(
        "--hostile-inputs",
        action="store_true",
        help="also run issue 52's hostile inputs (benchmarks/hostile_inputs.py)",
    )
    parser.add_argument("--max-steps", type=int, default=0, help="default: 6 per round + 4")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kinds = list(FAULTS) + (["disk-full"] if args.disk_full else [])
    faults = (
        args.faults.split(",") if args.faults else [rng.choice(kinds) for _ in range(args.rounds)]
    )
    max_steps = args.max_steps or 6 * len(faults) + 4
    started = time.monotonic()
    with small_filesystem(256) as small:
        if "disk-full" in faults and small is None:
            parser.error("disk-full rounds need root (a tmpfs is mounted for the run directory)")
        out = small if small is not None else Path(tempfile.mkdtemp(prefix="nmm_faults_"))
        report = run_faults(out, faults, args.seed, max_steps)
    extra_ok = True
    if args.hostile_names:
        report["hostile_names"] = check_hostile_names(Path(tempfile.mkdtemp(prefix="nmm_names_")))
        extra_ok &= all(report["hostile_names"].values())
        for case, ok in report["hostile_names"].items():
            print(f"hostile name {case:<28} {'refused, nothing touched' if ok else 'NOT MET'}")
    if args.hostile_inputs:
        from benchmarks.hostile_inputs import check_hostile_inputs

        report["hostile_inputs"] = check_hostile_inputs(Path(tempfile.mkdtemp(prefix="nmm_hi_")))
        for case, r in report["hostile_inputs"].items():
            extra_ok &= r["ok"]
            peak = f", peak {r['peak_mb']:.0f} MB" if r["peak_mb"] is not None else ""
            print(f"hostile input {case:<44} {'met' if r['ok'] else 'NOT MET'}{peak}")
    if args.io_error:
        report["io_error"] = check_io_error()
        if report["io_error"] is None:
            print("io-error: skipped (needs root, losetup and mkfs.ext4)")
        else:
            kept = report["io_error"]["kept"]
            ok = all(set(range(5)) <= set(kept[k]) for k in ("metrics.jsonl", "tensorboard"))
            extra_ok &= ok and kept["run.json"]
            print(f"io-error at step {report['io_error']['failed_at_step']}: kept {kept}")
    report["seconds"] = time.monotonic() - started
    for i, r in enumerate(report["rounds"]):
        print(
            f"round {i + 1}: {r['fault']:<9} after {r['logged_before']:>3} logged steps: exit "
            f"{r['exit_status']}, job gone in {r['stopped_s']:.1f} s"
            + ("" if r["expectation_met"] else f"  EXPECTATION NOT MET:\n{r['said']}")
        )
    for sink, r in report["sinks"].items():
        print(f"{sink:<17} lost {r['lost'] or 0}  duplicated {r['duplicated'] or 0}")
    print(f"lost {report['lost']}, duplicated {report['duplicated']} ({report['seconds']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = report["lost"] == 0 and report["duplicated"] == 0 and report["expectations_met"]
    ok = ok and extra_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

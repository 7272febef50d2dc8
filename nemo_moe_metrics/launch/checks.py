"""What a launcher checks before any process starts: the extras a recipe needs, the run
directory it may take (:func:`claim_run_dir`: the lock and the one-run policy of
:mod:`nemo_moe_metrics.run_dir.record`, an unusable path said in one line) and the steps a
resumed run has left."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

from nemo_moe_metrics.config import ConfigError, Recipe, load_recipe
from nemo_moe_metrics.run_dir.lock import RunDirError, RunDirLock, this_command
from nemo_moe_metrics.run_dir.record import check_before_lock, prepare_run_dir
from nemo_moe_metrics.run_dir.resume import read_resume_state
from nemo_moe_metrics.runtime.extras import check_extra


def check_launch_extras(recipe: Recipe) -> None:
    """Raise MissingExtraError before launching when an extra the recipe needs is missing."""
    check_extra("launch", "nemo-moe-metrics run")
    check_extra("megatron", "nemo-moe-metrics run (the megatron-core policy worker)")
    if recipe.logger.tensorboard_enabled:
        check_extra("tensorboard", "logger.tensorboard_enabled=true")
    if recipe.logger.wandb_enabled and recipe.logger.wandb_mode != "disabled":
        check_extra("wandb", "logger.wandb_enabled=true")


def check_resume_has_steps_left(run_dir: Path, recipe: Recipe, recipe_path: str | Path) -> None:
    """Raise ConfigError when the run to resume already reached ``training.max_steps``."""
    state = read_resume_state(run_dir)
    max_steps = recipe.training.max_steps
    if state.last_step is None or state.next_step < max_steps:
        return
    raise ConfigError(
        f"--resume: {run_dir} is already at training.max_steps={max_steps} (last logged step "
        f"{state.last_step}), so there is nothing left to train. To train further, raise "
        f"max_steps, e.g. nemo-moe-metrics run {recipe_path} training.max_steps={2 * max_steps} "
        "--resume; to look at it: nemo-moe-metrics report " + str(run_dir)
    )


def run_dir_for(recipe_path: str | Path, overrides: list[str], output_dir: str | Path) -> Path:
    """``output_dir/<recipe name>``: where a run of this recipe writes (validates the recipe)."""
    recipe = load_recipe(recipe_path, overrides)
    return Path(output_dir).resolve() / recipe.name


def claim_run_dir(
    run_dir: Path, *, resume: bool, overwrite: bool, say: Callable[[str], None]
) -> RunDirLock:
    """Take ``run_dir``'s lock and make it ready for the run (the rules of
    :mod:`nemo_moe_metrics.run_dir.record`), saying the notes; the lock, held. A directory
    that cannot be made or written (no permission, a read-only file system, a file in the way,
    a name too long) is a :class:`RunDirError` naming the path and the error, never a
    traceback."""
    try:
        # Said before the lock file would be created: a directory that is not a run's, and a
        # --resume of a directory that does not exist.
        check_before_lock(run_dir, resume=resume, overwrite=overwrite)
        if resume and not run_dir.is_dir():
            prepare_run_dir(run_dir, resume=True)
        lock = RunDirLock(run_dir, command=this_command()).acquire()  # before any write
    except OSError as err:
        raise RunDirError(_unusable(run_dir, err)) from None
    try:
        for note in lock.notes:
            say(note)
        note = prepare_run_dir(
            run_dir, resume=resume, overwrite=overwrite, earlier_lock=lock.previous
        )
        lock.mark_run()
    except OSError as err:
        lock.release()
        raise RunDirError(_unusable(run_dir, err)) from None
    except BaseException:
        lock.release()
        raise
    if note:
        say(note)
    return lock


def _unusable(run_dir: Path, err: OSError) -> str:
    name = errno.errorcode.get(err.errno or 0, "error")
    where = err.filename or run_dir
    return (
        f"cannot use the run directory {run_dir}: {where}: {err.strerror or err} ({name}). "
        f"Choose a --output-dir that this user can write (and a shorter one when the name is "
        f"too long), or fix that path"
    )

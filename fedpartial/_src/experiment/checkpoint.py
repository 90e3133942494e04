"""A run folder's checkpoints: ``checkpoints/<round>/`` (orbax), written and read back.

The folder's other files and its lock are :mod:`~fedpartial._src.experiment.run_files`'s, signals
:mod:`~fedpartial._src.experiment.signals`'. Decisions taken here:

* **What a checkpoint holds.**  The whole :class:`fedpartial._src.engine.round.ServerState`
  (round counter, variables, server optimizer state, method state) as a flat list of
  arrays, in ``jax.tree.flatten`` order of the live state; the tree structure itself
  comes from a freshly built :class:`~fedpartial._src.experiment.simulation.Simulation` of the same
  ``config.json``, so nothing pickled is stored.  Typed PRNG keys are stored as
  ``jax.random.key_data`` and rewrapped with the template's key implementation.
  Host-side values (``Simulation.progress``: rounds done, cumulative traffic and
  simulated time) go into a JSON item next to the arrays, with the checkpoint
  interval.  The cohort and keys of round ``t`` depend only on the seed and ``t``
  (``Simulation.sample_cohort``), and there is no numpy RNG that advances between
  rounds, so nothing else is needed for a resumed run to match an uninterrupted one
  bit for bit.
* **Leaves a format refuses** (orbax: an array of zero size, ``uint4``; ``np.savez``: ml_dtypes' types).
  A zero-size leaf is not stored, its shape and dtype are in the JSON item and rebuild it; a leaf of a
  dtype that is not plain numpy is stored as its bytes; every other leaf is stored as a plain array under its
  index, the layout every checkpoint has (:mod:`~fedpartial._src.experiment.checkpoint_arrays` says why).
* **Atomicity.**  Orbax's ``CheckpointManager`` writes a step into a temporary
  directory and renames it when complete; a kill mid-write leaves a temporary
  directory that is never read (``latest_step`` ignores it) and is removed the next
  time the manager opens the directory.  Saves are synchronous (no background
  thread a signal could cut).  The two newest checkpoints are kept.
* **Several processes** (multi-host, :mod:`fedpartial._src.engine.sharding`).  The server state
  is replicated, and each process writes its own run directory, so each writes a
  whole checkpoint there on its own: ``checkpoints/<round>/state.npz`` (the same flat
  arrays) and ``host.json``, written into a temporary folder renamed into place.
  Orbax is not used there: its manager synchronises every process on one shared
  directory, and it writes numpy arrays from process 0 only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time

import jax
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import checkpoint_arrays as stored_arrays
from fedpartial._src.experiment.checkpoint_arrays import checksum, from_arrays, to_arrays
from fedpartial._src.experiment.disk import OutOfSpace, free_bytes, human_bytes, out_of_space
from fedpartial._src.experiment.run_files import finite, write_json

CHECKPOINTS = "checkpoints"
#: checkpoints kept on disk (the newest, and one before it in case the newest is unreadable)
KEEP = 2


def _remove_partial_writes(run_dir: str, step: int) -> None:
    """Removes what a failed write of checkpoint ``step`` left: orbax's temporary folders, the per-process one."""
    root = os.path.join(run_dir, CHECKPOINTS)

    def partial() -> list[str]:
        names = os.listdir(root) if os.path.isdir(root) else []
        return [n for n in names if n.startswith(f"{step}.orbax-checkpoint-tmp") or n == f".{step}.tmp"]

    # A write cut short by a full disk can still be landing files from orbax's writer threads after the error
    # reached us (seen once on a loaded machine: the folder outlived one rmtree), so remove until none is left.
    for _ in range(50):
        left = partial()
        if not left:
            return
        for name in left:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        time.sleep(0.1)


class CheckpointsDamaged(UserError):
    """No checkpoint of a run folder reads back (each is truncated, zeroed, flipped or incomplete)."""



# --- checkpoints -----------------------------------------------------------------------------------------


def _manager(run_dir: str, *, read_only: bool = False):
    import orbax.checkpoint as ocp  # heavy: imported only when a checkpoint is written or read

    _drop_closed_loop_callbacks()
    options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, enable_async_checkpointing=False, create=not read_only,
                                           cleanup_tmp_directories=not read_only, read_only=read_only)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, CHECKPOINTS)), options=options,
                                 item_names=("state", "host"))


# --- several processes: a whole checkpoint per process, in its own run directory --------------------------
LOCAL_ARRAYS, LOCAL_HOST = "state.npz", "host.json"


def several_processes() -> bool:
    """A run over several processes (``jax.distributed``) checkpoints in the per-process format."""
    return jax.process_count() > 1


def _local_rounds(run_dir: str) -> list[int]:
    """Rounds with a complete per-process checkpoint (a round's folder appears only once complete)."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    return sorted(int(d) for d in os.listdir(root)
                  if d.isdigit() and os.path.isfile(os.path.join(root, d, LOCAL_HOST)))


def _save_local(run_dir: str, step: int, arrays: dict, host: dict) -> None:
    root = os.path.join(run_dir, CHECKPOINTS)
    tmp, final = os.path.join(root, f".{step}.tmp"), os.path.join(root, str(step))
    shutil.rmtree(tmp, ignore_errors=True)  # a write cut short before
    os.makedirs(tmp)
    with open(os.path.join(tmp, LOCAL_ARRAYS), "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    write_json(os.path.join(tmp, LOCAL_HOST), host)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in _local_rounds(run_dir)[:-KEEP]:
        shutil.rmtree(os.path.join(root, str(old)))


def _restore_local(run_dir: str, step: int) -> tuple[dict, dict]:
    folder = os.path.join(run_dir, CHECKPOINTS, str(step))
    with np.load(os.path.join(folder, LOCAL_ARRAYS), allow_pickle=False) as arrays:
        state = {name: arrays[name] for name in arrays.files}
    with open(os.path.join(folder, LOCAL_HOST)) as f:
        return state, json.load(f)


def latest_round(run_dir: str) -> int | None:
    """The round of the newest complete checkpoint in ``run_dir``, or None."""
    if several_processes():
        return (_local_rounds(run_dir) or [None])[-1]
    if not os.path.isdir(os.path.join(run_dir, CHECKPOINTS)):
        return None
    with _manager(run_dir, read_only=True) as mgr:
        return mgr.latest_step()


def save(run_dir: str, sim, *, extra: dict | None = None) -> int:
    """Writes ``sim``'s state and progress as checkpoint ``sim.progress['round']``; returns that round."""
    import orbax.checkpoint as ocp

    step = int(sim.progress["round"])
    state = sim.checkpoint_state()  # per-client rows kept off the device included
    arrays = to_arrays(state)
    stored, layout = stored_arrays.encode(arrays)  # zero-size leaves left out, exotic dtypes as bytes
    host = {"progress": dict(sim.progress), "num_leaves": len(arrays), "checksum": checksum(stored), **layout,
            **(extra or {})}
    kept = latest_round(run_dir)
    if kept == step:
        return step  # already saved after this round
    try:
        if several_processes():
            _save_local(run_dir, step, stored, finite(host))
        else:
            with _quiet_orbax_errors(), _manager(run_dir) as mgr:
                mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(stored),
                                                       host=ocp.args.JsonSave(finite(host))), force=True)
                mgr.wait_until_finished()
    except Exception as error:
        reason = out_of_space(error)
        if reason is None:
            raise
        _remove_partial_writes(run_dir, step)
        need = sum(a.nbytes for a in stored.values())
        free = free_bytes(run_dir)
        room = f"it needs about {human_bytes(need)}" + (f", {human_bytes(free)} are free there" if free else "")
        then = (f"the checkpoint of round {kept} is kept; make room and continue with: "
                f"fedpartial run --resume {run_dir}" if kept is not None else "no earlier checkpoint was written")
        raise OutOfSpace(f"cannot write the checkpoint of round {step} in {os.path.join(run_dir, CHECKPOINTS)}: "
                         f"{reason} ({room}); {then}.") from None
    return step


def _all_rounds(run_dir: str) -> list[int]:
    """Rounds with a complete checkpoint, oldest first."""
    if several_processes():
        return _local_rounds(run_dir)
    if not os.path.isdir(os.path.join(run_dir, CHECKPOINTS)):
        return []
    with _manager(run_dir, read_only=True) as mgr:
        return sorted(mgr.all_steps())


def _read_host(run_dir: str, step: int) -> dict:
    """Checkpoint ``step``'s host item (progress, checksum, what wrote it)."""
    import orbax.checkpoint as ocp

    if several_processes():
        with open(os.path.join(run_dir, CHECKPOINTS, str(step), LOCAL_HOST)) as f:
            host = json.load(f)
    else:
        with _manager(run_dir, read_only=True) as mgr:
            host = dict(mgr.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"])
    if not isinstance(host.get("progress"), dict):
        raise ValueError("its host record has no progress")
    return host


def _read_arrays(run_dir: str, step: int, template: dict, host: dict) -> dict:
    """Checkpoint ``step``'s arrays (:func:`~.checkpoint_arrays.to_arrays`'s layout), verified against the checksum in
    ``host`` (a checkpoint written without one is read unchecked)."""
    import orbax.checkpoint as ocp

    if several_processes():
        stored, _ = _restore_local(run_dir, step)
    else:
        like = stored_arrays.stored_like(template, host)  # as the host record says they were stored
        with _manager(run_dir, read_only=True) as mgr:
            stored = dict(mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like)))["state"])
    expected = host.get("checksum")
    if expected is not None and checksum(stored) != expected:
        raise ValueError("its arrays do not match their stored checksum")
    return stored_arrays.decode(stored, host)


def _check_identity(run_dir: str, written: dict | None, identity: dict | None) -> None:
    """A checkpoint written by another configuration (config.json edited since) is refused, not damage."""
    if not written or not identity:
        return
    for field, now in identity.items():
        if field in written and written[field] != now:
            raise UserError(f"{os.path.join(run_dir, 'config.json')} has {field} = {now!r}, but the run's "
                            f"checkpoints were written with {field} = {written[field]!r}; put config.json back "
                            "as it was, or start a new run.")


@contextlib.contextmanager
def _quiet_orbax_errors():
    """Orbax logs a failed write's exception from each of its threads (absl ERROR lines with tracebacks) before
    raising it; the caller turns the raised one into a sentence, so those lines are held back meanwhile."""
    logger = logging.getLogger("absl")
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _orbax_task_leftovers(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's 'Task exception was never retrieved' about an orbax task: the failure it
    reports was raised by the orbax call itself and is said in one sentence there."""
    message = record.getMessage()
    return not (message.startswith("Task exception was never retrieved") and "orbax" in message)


def _drop_closed_loop_callbacks() -> None:
    """When an orbax read or write fails, its asyncio callbacks still fire, from tensorstore's threads, on an
    event loop orbax has closed, and Python prints each as a traceback (during the failing call or later).
    From the first use of orbax on, those (RuntimeError 'Event loop is closed', and only those) are dropped, and
    so are asyncio's notes of orbax tasks whose exception nobody retrieved (:func:`_orbax_task_leftovers`)."""
    if getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
        return
    logging.getLogger("asyncio").addFilter(_orbax_task_leftovers)  # its failed tasks, collected later
    previous = sys.unraisablehook

    def hook(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and "Event loop is closed" in str(error)):
            previous(unraisable)

    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def _damage(error: BaseException) -> str:
    """One line for why a checkpoint did not restore (orbax's and tensorstore's messages run to many lines)."""
    first = (str(error).strip().splitlines() or [""])[0].strip().rstrip(".")
    if len(first) > 120:
        first = first[:117] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _set_aside(run_dir: str, step: int) -> str:
    """Renames damaged checkpoint ``step`` to ``checkpoints/damaged-<step>[-n]`` (kept for inspection, never
    read again: orbax and :func:`_local_rounds` list numeric folders only); returns the new path."""
    root = os.path.join(run_dir, CHECKPOINTS)
    target, n = os.path.join(root, f"damaged-{step}"), 1
    while os.path.exists(target):
        target, n = os.path.join(root, f"damaged-{step}-{n}"), n + 1
    os.replace(os.path.join(root, str(step)), target)
    return target


def restore(run_dir: str, sim, step: int | None = None, *, identity: dict | None = None) -> dict:
    """Loads checkpoint ``step`` (default: the newest that restores and matches its checksum) into ``sim``
    (state and progress); returns its host item.

    Without ``step``, a newer checkpoint that does not restore (truncated, zeroed or flipped bytes, a missing
    orbax metadata file) is set aside as ``checkpoints/damaged-<round>`` and the next older one is tried; the
    host item's ``"damaged"`` then lists ``(round, why)`` for each one set aside.  A checkpoint written by a
    different configuration is not damage: that is a :class:`UserError` at once (``identity``: the
    settings that determine the state, compared with the ``"written_by"`` that :func:`save`'s caller stored).
    """
    rounds = _all_rounds(run_dir) if step is None else [step]
    if not rounds:
        raise UserError(f"{run_dir} has no checkpoint to resume from (it stopped before its first one); "
                        "start the run again.")
    template = to_arrays(sim.checkpoint_state())
    damaged: list[tuple[int, str]] = []
    for candidate in reversed(rounds):
        try:
            with _quiet_orbax_errors():
                host = _read_host(run_dir, candidate)
                _check_identity(run_dir, host.get("written_by"), identity)
                arrays = _read_arrays(run_dir, candidate, template, host)
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 — any failure to read a checkpoint back is damage to it
            damaged.append((candidate, _damage(error)))
            continue
        state = from_arrays(arrays, sim.checkpoint_state(), put=False)  # a shape mismatch: UserError
        aside = [(bad, why, os.path.basename(_set_aside(run_dir, bad))) for bad, why in damaged]
        sim.load_state(state)
        sim.progress = {**sim.progress, **host["progress"]}
        return {**host, "damaged": aside}
    listed = "; ".join(f"round {r}: {why}" for r, why in damaged)
    raise CheckpointsDamaged(f"no checkpoint in {os.path.join(run_dir, CHECKPOINTS)} can be read back ({listed}); "
                    "they are left as they are; start the run again.")

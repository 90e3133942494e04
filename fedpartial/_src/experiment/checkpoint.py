"""Checkpoints, run status and clean interruption of a run directory.

A run directory holds ``config.json``, ``metrics.jsonl``, ``summary.json``,
``status.json`` and ``checkpoints/<round>/`` (orbax).  Decisions taken here:

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
  dtype that is not plain numpy is stored as its bytes; every other leaf is stored as it always was, so
  older checkpoints restore unchanged (:mod:`~fedpartial._src.experiment.checkpoint_arrays` says why).
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
* **Strict JSON.**  Result files never contain bare ``NaN``/``Infinity``: a
  non-finite float is written as ``null`` (:func:`strict_json`).
* **Signals.**  :class:`StopFlag` turns SIGINT/SIGTERM into a flag checked between
  rounds, so a signal during JAX compilation or a round never interrupts native
  code; the round finishes, a checkpoint is written and the run stops with status
  ``interrupted`` (exit status 130 / 143 on the command line).  A second signal is
  deferred too (it only repeats the notice).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time

import jax
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import checkpoint_arrays as stored_arrays
from fedpartial._src.experiment.checkpoint_arrays import checksum
from fedpartial._src.experiment.checkpoint_arrays import from_arrays as _from_arrays
from fedpartial._src.experiment.checkpoint_arrays import is_key as _is_key  # noqa: F401  (tests use it here)
from fedpartial._src.experiment.checkpoint_arrays import to_arrays as _to_arrays
from fedpartial._src.experiment.disk import OutOfSpace, free_bytes, human_bytes, out_of_space

CHECKPOINTS = "checkpoints"
STATUS = "status.json"
STATUSES = ("running", "complete", "interrupted", "diverged", "failed")
#: checkpoints kept on disk (the newest, and one before it in case the newest is unreadable)
KEEP = 2


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM after writing its checkpoint, status and summary (a
    ``KeyboardInterrupt``, so ``except Exception`` does not swallow a person's Ctrl-C).

    ``signum`` is the signal, ``exit_code`` 128 + signum, ``message`` says what was kept,
    ``summary`` is what :func:`fedpartial._src.experiment.simulation.run` would have returned.
    """

    def __init__(self, signum: int, message: str, summary: dict | None = None):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
        self.message = message
        self.summary = summary


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


def is_diverged(error: BaseException) -> bool:
    """Whether ``error`` is :class:`fedpartial._src.core.errors.DivergedError` (matched by name, so this module does
    not depend on where it is defined)."""
    return isinstance(error, UserError) and type(error).__name__ == "DivergedError"


# --- strict JSON ---------------------------------------------------------------------------------------


def _finite(value):
    """``value`` with every non-finite float replaced by ``None`` and numpy scalars/arrays made plain."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.ndarray):
        return _finite(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def strict_json(value, **kwargs) -> str:
    """``json.dumps`` that never writes ``NaN``/``Infinity``: non-finite floats become ``null``."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def write_json(path: str, value) -> None:
    """Writes ``value`` as strict JSON to ``path`` atomically (a temporary file renamed over it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(strict_json(value, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- status ----------------------------------------------------------------------------------------------


def write_status(run_dir: str, status: str, *, round: int, message: str, checkpoint_round: int | None) -> None:
    """``RUN_DIR/status.json``: the run's state, the rounds it completed, one sentence, the newest checkpoint."""
    assert status in STATUSES, status
    write_json(os.path.join(run_dir, STATUS), {
        "status": status, "round": round, "message": message, "checkpoint_round": checkpoint_round,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


def read_status(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, STATUS)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# --- the run folder's lock ------------------------------------------------------------------------------


def _lock_path(run_dir: str) -> str:
    # One per process: the processes of one multi-process run share the folder, each holding its own lock.
    return os.path.join(run_dir, f"lock-{jax.process_index()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def lock_run_dir(run_dir: str) -> str | None:
    """Takes ``run_dir``'s lock (a file holding this process's pid and host) so that no second process writes
    the folder at the same time.  Held by a live process: one sentence (:class:`UserError`).  Left by a process
    that is no longer running: taken over, and the sentence saying so is returned (None otherwise)."""
    path, mine = _lock_path(run_dir), f"{os.getpid()} {socket.gethostname()}\n"
    note = None
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    pid_text, _, host = f.read().strip().partition(" ")
                pid = int(pid_text)
            except (OSError, ValueError):
                pid, host = None, ""
            here = host == socket.gethostname()
            if pid is not None and pid != os.getpid() and (not here or _alive(pid)):
                where = "" if here else f" on {host}"
                raise UserError(f"{run_dir} is in use by process {pid}{where} (its lock file {path}); wait for it to "
                                f"finish or stop it{'' if here else ', or delete the lock file if it has ended'}.")
            if pid is not None and pid != os.getpid():
                note = f"took over the lock of {run_dir} from process {pid}, which is no longer running"
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(mine)
        return note
    raise UserError(f"{run_dir}'s lock file {path} keeps coming back; another process is taking it.")


def unlock_run_dir(run_dir: str) -> None:
    """Gives ``run_dir``'s lock back, if this process holds it."""
    path = _lock_path(run_dir)
    with contextlib.suppress(OSError):
        with open(path) as f:
            if f.read().split(" ")[0] != str(os.getpid()):
                return
        os.remove(path)


# --- signals ---------------------------------------------------------------------------------------------


#: seconds a second SIGINT/SIGTERM gives the round in progress before the process exits without it
FORCE_GRACE_S = 3.0


class StopFlag:
    """Context manager: SIGINT and SIGTERM set :attr:`signum` instead of raising, until exit.

    A second signal forces the exit: if the run has not stopped ``grace_s`` seconds later (a long round,
    a long compilation), a timer thread runs the ``on_force`` callbacks (e.g. the run folder's status),
    says what is lost and kept, and ends the process with 128 + signum (``exit``: :func:`os._exit`, as
    native code may hold the main thread).  Installed only in the main thread (Python delivers signals
    there); elsewhere it is an inert flag.  Nested use keeps the outer handlers (``installed`` is False).
    """

    def __init__(self, stream=None, *, grace_s: float = FORCE_GRACE_S, exit=os._exit):
        self.signum: int | None = None
        self.stream = stream if stream is not None else sys.stderr
        self.installed = False
        self._previous = {}
        self.grace_s, self._exit = grace_s, exit
        self.on_force: list = []  # callables run before a forced exit, e.g. writing status.json
        self._timer: threading.Timer | None = None

    def _say(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream must not turn a stop into a crash
            pass

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            self._say(f"fedpartial: {name} received; stopping after the current round and writing a "
                      f"checkpoint (again to exit at once).\n")
            return
        if self._timer is None:
            self._say(f"fedpartial: {name} received again; exiting in {self.grace_s:g} s unless the round "
                      "ends first.\n")
            self._timer = threading.Timer(self.grace_s, self._force, args=(signum,))
            self._timer.daemon = True
            self._timer.start()

    def _force(self, signum: int) -> None:
        for callback in self.on_force:
            try:
                callback()
            except Exception:  # noqa: BLE001 — exiting is what was asked; a failed note must not stop it
                pass
        self._say("fedpartial: exited without finishing the round in progress; the newest checkpoint and the "
                  "metrics of finished rounds are kept.\n")
        self._exit(128 + signum)

    @property
    def stopped(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
            self.installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:  # the run stopped within the grace: no forced exit
            self._timer.cancel()
            self._timer = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self.installed = False


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
    arrays = _to_arrays(state)
    stored, layout = stored_arrays.encode(arrays)  # zero-size leaves left out, exotic dtypes as bytes
    host = {"progress": dict(sim.progress), "num_leaves": len(arrays), "checksum": checksum(stored), **layout,
            **(extra or {})}
    kept = latest_round(run_dir)
    if kept == step:
        return step  # already saved after this round
    try:
        if several_processes():
            _save_local(run_dir, step, stored, _finite(host))
        else:
            with _quiet_orbax_errors(), _manager(run_dir) as mgr:
                mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(stored),
                                                       host=ocp.args.JsonSave(_finite(host))), force=True)
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
    ``host`` (older checkpoints have none)."""
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
    template = _to_arrays(sim.checkpoint_state())
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
        state = _from_arrays(arrays, sim.checkpoint_state(), put=False)  # a shape mismatch: UserError
        aside = [(bad, why, os.path.basename(_set_aside(run_dir, bad))) for bad, why in damaged]
        sim.load_state(state)
        sim.progress = {**sim.progress, **host["progress"]}
        return {**host, "damaged": aside}
    listed = "; ".join(f"round {r}: {why}" for r, why in damaged)
    raise CheckpointsDamaged(f"no checkpoint in {os.path.join(run_dir, CHECKPOINTS)} can be read back ({listed}); "
                    "they are left as they are; start the run again.")

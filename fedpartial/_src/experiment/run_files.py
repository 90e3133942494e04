"""A run folder's own files: strict JSON, ``status.json`` and the folder's lock.

* **Strict JSON.**  Result files never contain bare ``NaN``/``Infinity``: a non-finite float is written as
  ``null`` (:func:`strict_json`), and every file is written atomically (a temporary file renamed over it).
* **Status.**  ``status.json`` says whether the run is ``running``, ``complete``, ``interrupted``, ``diverged`` or
  ``failed``, the rounds it completed, one sentence, and its newest checkpoint.
* **Lock.**  One file per process (``lock-<process>``) holding its pid and host, so that no second process
  writes the folder at the same time; a lock whose process has ended is taken over.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time

import jax
import numpy as np

from fedpartial._src.core.errors import DivergedError, UserError

STATUS = "status.json"
STATUSES = ("running", "complete", "interrupted", "diverged", "failed")


def is_diverged(error: BaseException) -> bool:
    """Whether ``error`` is a :class:`~fedpartial._src.core.errors.DivergedError` (status ``diverged``)."""
    return isinstance(error, DivergedError)


# --- strict JSON ---------------------------------------------------------------------------------------


def finite(value):
    """``value`` with every non-finite float replaced by ``None`` and numpy scalars/arrays made plain."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, np.ndarray):
        return finite(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def strict_json(value, **kwargs) -> str:
    """``json.dumps`` that never writes ``NaN``/``Infinity``: non-finite floats become ``null``."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


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


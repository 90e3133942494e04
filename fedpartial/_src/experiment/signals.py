"""Clean interruption: SIGINT/SIGTERM become a flag checked between rounds.

:class:`StopFlag` turns a signal into a flag, so a signal during JAX compilation or a round never interrupts
native code; the round finishes, a checkpoint is written and the run stops with status ``interrupted`` (exit
status 130 / 143 on the command line, :class:`RunInterrupted`).  A second signal forces the exit after a short
grace.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

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


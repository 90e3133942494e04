"""``--strategy auto`` on a CPU of several cores: the cohort split over them unless one device measures faster.

A round on one XLA:CPU device runs one client's small operations across every core, which scales poorly; the
split gives each core its own single-threaded device and its own clients (``stepwise:1`` or ``fused:1`` over
the devices, see :mod:`fedpartial._src.engine.conv_choice`).  The number of CPU devices and their threading are
fixed when JAX starts, so the command line decides before the run is built
(:func:`~fedpartial._src.experiment.parts.choose_core_split`):

1. the one-device choice is measured as ``--conv-impl auto`` measures it (kept in ``conv-impl.json``), by
   timing a round as the run has it (:mod:`fedpartial._src.engine.conv_choice`), and timed again now;
2. a child process started with :func:`flags` times a round of the cohort split over the cores
   (:func:`~fedpartial._src.engine.conv_choice.time_split`; kept in ``core-split.json``, so once per setting);
3. unless one device is faster than the fastest split by more than
   :data:`~fedpartial._src.engine.conv_choice.MARGIN` (:func:`decide`), the command runs itself again
   (:func:`restart`) with those flags and :data:`ENV` naming the split, before anything is written; in that
   process :func:`active` gives the split, which the plan and the lowering follow.

Only a synchronous, single-process run with ``--strategy auto`` and no ``--devices`` is considered, on a CPU
backend with one device, and not when ``FEDPARTIAL_CONV_IMPL`` fixes the lowering (the test suite sets it: no
test spends seconds measuring).  From Python, set the flags before JAX starts and pass ``devices``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys

import jax

from fedpartial._src.engine import conv_choice

__all__ = ["CACHE_FILE", "ENV", "CoreSplit", "active", "candidates", "cores", "decide", "flags", "for_config",
           "measure", "restart", "skip_reason", "split_seconds"]

#: names the split a restarted process runs (JSON of :class:`CoreSplit`)
ENV = "FEDPARTIAL_CORE_SPLIT"
CACHE_FILE = "core-split.json"


def flags(devices: int) -> str:
    """XLA's flags for ``devices`` single-threaded CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} --xla_cpu_multi_thread_eigen=false"


#: the most devices a split uses: each compiles the round's programs for itself (measured on 2 cores only)
MAX_DEVICES = 8


def cores() -> int:
    """The cores this process may run on, at most :data:`MAX_DEVICES`."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    return min(count, MAX_DEVICES)


@dataclasses.dataclass(frozen=True)
class CoreSplit:
    """The cohort split over ``devices`` single-threaded CPU devices, each training its clients in ``layout``
    (``loop``: ``stepwise:1``; ``map``: ``fused:1``) with the ``impl`` lowering; ``seconds``: one round of the
    cohort, per candidate split and ``one_device`` the one-device choice's."""

    devices: int
    impl: str
    layout: str
    seconds: dict
    one_device: dict

    @property
    def speedup(self) -> float:
        return min(self.one_device.values()) / self.seconds[f"{self.impl}/{self.layout}"]

    def describe(self) -> str:
        split, one = self.seconds[f"{self.impl}/{self.layout}"], min(self.one_device.values())
        kept = "" if self.speedup >= 1 else \
            f" (one device is not faster by over {conv_choice.MARGIN:.0%}: the split is the default)"
        return (f"the cohort split over the {self.devices} CPU cores, one single-threaded device each: "
                f"{split:.3g} s a round against {one:.3g} s on one device, measured{kept}")


def active() -> CoreSplit | None:
    """The split this process was restarted to run (:data:`ENV`), when its devices are there."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        split = CoreSplit(**json.loads(text))
    except (TypeError, ValueError):
        return None
    if jax.default_backend() != "cpu" or jax.local_device_count() != split.devices:
        return None
    return split


def for_config(config) -> CoreSplit | None:
    """:func:`active` for a run that leaves the split to ``auto`` (``--strategy auto``, no ``--devices``)."""
    return active() if config.strategy == "auto" and config.devices is None else None


def skip_reason(config, second_order: bool = False) -> str | None:
    """Why the split is not considered for ``config`` (None: it is)."""
    if config.strategy != "auto" or config.devices is not None:
        return "--strategy or --devices given"
    if getattr(config, "mode", "sync") != "sync" or getattr(config, "lora", None) is not None:
        return "asynchronous runs and LoRA models run on one device"
    if os.environ.get("FEDPARTIAL_CONV_IMPL") or os.environ.get(ENV) is not None:
        return "FEDPARTIAL_CONV_IMPL fixes the lowering, or this process is the split"
    if os.name != "posix" or cores() < 2 or config.cohort_size < 2:
        return "one core or one client"
    if jax.default_backend() != "cpu" or jax.local_device_count() != 1 or jax.process_count() != 1:
        return "not one CPU device in one process"
    return None


def candidates(conv_impl: str, convolutions: bool, second_order: bool) -> tuple:
    """The (lowering, layout) pairs the split is timed in: with a named lowering, that one a client at a time."""
    if conv_impl != "auto":
        return ((conv_impl, "loop"),)
    pairs = conv_choice.SPLIT_CANDIDATES["conv" if convolutions else "dense"]
    return tuple(p for p in pairs if not (second_order and p[0] in conv_choice.REVERSE_ONLY))


def decide(one_device: dict, seconds: dict, devices: int) -> CoreSplit | None:
    """The fastest split of ``seconds`` (a round per "impl/layout"), unless ``one_device``'s is faster
    than it by more than :data:`~fedpartial._src.engine.conv_choice.MARGIN`; None for one device, or when
    nothing was measured.

    The split is the default that one device must beat, as the lowering chooser keeps its first candidate
    unless another beats it: in the peer benchmark of 2026-12-05 the split was the fastest configuration in
    all 6 rows, 1.15-4.8x one device's best in whole rounds, while a step timed on a shared machine drifted by
    up to 1.5x between runs (held to beating one device, the split lost a near-tie to one device's vmapped MLP
    step at K = 50, whose rounds were 1.5x slower)."""
    if not seconds:
        return None
    best = min(seconds, key=seconds.get)
    if min(one_device.values()) < (1 - conv_choice.MARGIN) * seconds[best]:
        return None
    impl, layout = best.split("/")
    return CoreSplit(devices, impl, layout, seconds, one_device)


def split_seconds(model_spec: tuple[str, dict], round_spec: tuple[str, dict], pairs, *, devices: int,
                  batch_size: int, cohort_size: int, local_steps: int, timeout: float = 600) -> dict:
    """A round's seconds per pair of ``pairs`` with the cohort split over ``devices`` single-threaded CPU devices,
    timed in a process started with :func:`flags` ({} if it failed).  ``model_spec``: ``("module:function",
    kwargs)`` building the model as ``function(conv_impl=IMPL, **kwargs)`` there; ``round_spec``: the same for
    the round, ``function(model, strategy, clients, devices, **kwargs)``
    (:data:`~fedpartial._src.engine.conv_choice.RoundFor`)."""
    spec = {"model": list(model_spec), "round": list(round_spec), "pairs": [list(p) for p in pairs],
            "batch_size": batch_size, "cohort_size": cohort_size, "local_steps": local_steps}
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags(devices)}".strip(),
           "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run([sys.executable, "-m", __name__, json.dumps(spec)], capture_output=True, text=True,
                              env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("CORE-SPLIT ")]
    return json.loads(lines[-1][len("CORE-SPLIT "):]) if done.returncode == 0 and lines else {}


def measure(model_spec: tuple[str, dict], round_spec: tuple[str, dict], one_pair: tuple[str, str], pairs, *,
            devices: int, batch_size: int, cohort_size: int, local_steps: int) -> dict:
    """What :func:`decide` weighs: ``{"one_device": {"impl/layout": s}, "split": {"impl/layout": s}}``, a round
    of the one-device choice ``one_pair`` timed here now, as often as each split candidate, and of the split over
    ``devices`` timed in its own process (:func:`split_seconds`; ``{}`` if that failed).  Both sides minutes
    apart at most: a machine's speed drifts more than that over a day.  The specs: as :func:`split_seconds`'s."""
    model = _function(model_spec[0])(conv_impl=one_pair[0], **model_spec[1])
    one = conv_choice.time_candidate(_round_for(round_spec), model, one_pair[1], batch_size=batch_size,
                                     cohort_size=cohort_size, local_steps=local_steps,
                                     repeats=conv_choice.SPLIT_REPEATS)
    return {"one_device": {"/".join(one_pair): one},
            "split": split_seconds(model_spec, round_spec, pairs, devices=devices, batch_size=batch_size,
                                   cohort_size=cohort_size, local_steps=local_steps)}


def _function(spec: str):
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


def _round_for(round_spec: tuple[str, dict]):
    build, kwargs = _function(round_spec[0]), round_spec[1]
    return lambda model, strategy, clients, devices: build(model, strategy, clients, devices, **kwargs)


def _time_in_child(spec: dict) -> dict:
    build, kwargs = _function(spec["model"][0]), spec["model"][1]
    return conv_choice.time_split(lambda impl: build(conv_impl=impl, **kwargs), _round_for(spec["round"]),
                                  [tuple(p) for p in spec["pairs"]], jax.local_device_count(),
                                  batch_size=spec["batch_size"], cohort_size=spec["cohort_size"],
                                  local_steps=spec["local_steps"])


def restart(split: CoreSplit, argv: list[str]) -> None:
    """Runs ``python -m fedpartial ARGV`` in place of this process, with the split's devices and :data:`ENV`."""
    env = {**os.environ, ENV: json.dumps(dataclasses.asdict(split)),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags(split.devices)}".strip()}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "fedpartial", *argv], env)


if __name__ == "__main__":
    print("CORE-SPLIT " + json.dumps(_time_in_child(json.loads(sys.argv[1]))), flush=True)

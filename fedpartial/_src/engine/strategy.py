"""How a round executes: :class:`Strategy` and its constructors.

Three execution strategies compute the same round (:mod:`fedpartial._src.engine.runners` runs each):

* :func:`fused` — the whole round is one jitted function (the server state is
  donated): clients vmapped (or ``lax.map``-ped in chunks of vmapped clients),
  local steps in ``lax.scan``.  Best on accelerators: one launch keeps the
  device busy.
* :func:`stepwise` — the same client step, jitted over a chunk of clients and
  driven by a host loop over steps; plan and aggregation are jitted separately.
  Best on CPUs, where XLA runs a conv step inside ``lax.scan`` and vmapped
  per-client conv weights markedly slower than a loop of jitted steps.
* :func:`streamed` — the cohort a chunk of clients at a time, folded into running sums
  (bounded memory; only methods :func:`stream_refusal` accepts).
* :func:`debug` — nothing jitted, one client at a time, so an error inside a
  method's hook points at the method's own line.

``default_strategy`` and :func:`bounded_strategy` are what ``auto`` resolves to;
:func:`parse_strategy` reads ``--strategy``.
"""

from __future__ import annotations

import dataclasses

import jax

from fedpartial._src.core.types import Method
from fedpartial._src.models.adapter import Model

STRATEGY_KINDS = ("fused", "stepwise", "debug", "stream")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a round executes. Build with :func:`fused`, :func:`stepwise`, :func:`debug` or :func:`streamed`.

    Attributes:
      kind: ``"fused"`` (one jitted round), ``"stepwise"`` (a host loop of jitted steps), ``"debug"``
        (nothing jitted) or ``"stream"`` (the cohort a chunk of clients at a time).
      chunk_size: clients trained at once (None: the whole cohort).
      unroll: the local-step ``lax.scan``'s unroll (``True``: fully unrolled).
      stepwise_chunks: the streamed strategy only: each chunk trained by a host loop of jitted steps (the
        stepwise layout, fast for conv models on CPU) instead of one jitted ``lax.scan`` over its steps.

    Examples:
      >>> import fedpartial as fp
      >>> str(fp.streamed(100)), str(fp.parse_strategy("fused:50"))
      ('stream:100', 'fused:50')
    """

    kind: str
    chunk_size: int | None = None
    unroll: int | bool = 1
    stepwise_chunks: bool = False

    def __post_init__(self):
        if self.kind not in STRATEGY_KINDS:
            raise ValueError(f"strategy {self.kind!r} is unknown; use one of {', '.join(STRATEGY_KINDS)}.")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk size {self.chunk_size} must be a positive number of clients.")
        if self.stepwise_chunks and self.kind != "stream":
            raise ValueError(f"stepwise chunks are a choice of the streamed strategy, not of {self.kind!r}.")

    @property
    def name(self) -> str:
        """The strategy's name as ``--strategy`` spells it, without the chunk (e.g. ``stream-stepwise``)."""
        return "stream-stepwise" if self.stepwise_chunks else self.kind

    def __str__(self) -> str:
        return self.name if self.chunk_size is None else f"{self.name}:{self.chunk_size}"


def fused(chunk_size: int | None = None, unroll: int | bool = 1) -> Strategy:
    """Whole round in one jit; ``chunk_size`` clients vmapped at a time (None: all).

    ``unroll`` is passed to the local-step ``lax.scan``: ``True`` unrolls all steps,
    which on CPU lets XLA give convolutions their fast layout (compiles longer).

    Args:
      chunk_size: clients vmapped at a time (None: all).
      unroll: the local-step scan's unroll.

    Returns:
      The :class:`~fedpartial.Strategy`.

    Examples:
      >>> import fedpartial as fp
      >>> str(fp.fused(50))
      'fused:50'
    """
    return Strategy("fused", chunk_size, unroll)


def stepwise(chunk_size: int = 1) -> Strategy:
    """Host loop over local steps of a jitted step over ``chunk_size`` clients.

    Args:
      chunk_size: clients vmapped in each jitted step.

    Returns:
      The :class:`~fedpartial.Strategy`.

    Examples:
      >>> import fedpartial as fp
      >>> str(fp.stepwise())
      'stepwise:1'
    """
    return Strategy("stepwise", chunk_size)


def streamed(chunk_size: int, stepwise: bool = False) -> Strategy:
    """The cohort ``chunk_size`` clients at a time, folded into running sums of the one formula:
    peak memory O(chunk × model), not O(K × model); only :attr:`Method.streamable` methods.

    ``stepwise``: each chunk is trained by a host loop of jitted steps, as :func:`stepwise` trains
    (``chunk_size`` 1: one client, un-vmapped), instead of one jitted ``lax.scan`` of vmapped steps,
    which on CPU runs conv models several times slower than a plain loop.

    Args:
      chunk_size: clients trained at once.
      stepwise: train each chunk step by step.

    Returns:
      The :class:`~fedpartial.Strategy`.

    Examples:
      >>> import fedpartial as fp
      >>> str(fp.streamed(100, stepwise=True))
      'stream-stepwise:100'
    """
    if chunk_size is None:
        raise ValueError("the streamed strategy needs a chunk size (clients trained at a time).")
    return Strategy("stream", chunk_size, stepwise_chunks=stepwise)


def debug() -> Strategy:
    """Nothing jitted, one client and one step at a time (for finding errors, not speed)."""
    return Strategy("debug")


def default_strategy(platform: str | None = None, model: Model | None = None, layout: str | None = None) -> Strategy:
    """The strategy 'auto' resolves to, by platform and model (README "Throughput" has the measurements).

    * GPU/TPU: ``fused(None)``, the whole cohort vmapped in one jit, for every model (H100: 9-40x a
      plain per-client loop; chunks of 20 were no faster at K = 200).  Cohorts too large to vmap at
      once are the memory rule's business, not this one's.
    * CPU, no measured layout: ``stepwise(1)``, one client at a time (``--conv-impl auto`` measures the layout
      of every model with float inputs and one label per example, dense ones included, see ``layout``).  ``fedpartial bench --preset quick``
      (2 shared cores, S = 5, B = 16): 1.04-1.48x the plain loop for MLP and LeNet5 at K = 20 and 100,
      0.98x for the CNN at K = 20, where ``fused:20`` measured 0.74-0.95x (MLP) and ``stepwise:20``
      0.22-1.04x; vmapped conv steps run 10-20x slower than a loop of jitted steps, and for dense-only
      models no vmapped or chunked variant beat ``stepwise(1)`` either, so the model does not change
      the choice on CPU.  The exception is a LoRA model (:func:`~fedpartial.models.lora`): the frozen
      base is the same for every client, so vmapped over the cohort each of its products is one matrix product
      over every client's tokens; ``python -m benchmarks.lora_speed`` (FedIT, 5 steps of 16 sequences of 32
      tokens, rank 8): ``fused`` took 0.907 s a round against 0.949 s for ``stepwise:1`` with the tiny
      transformer at K = 32, and 2.07 s against 2.60 s with the small one at K = 8.

    ``layout``: the cohort layout ``--conv-impl auto`` measured fastest for this model's lowering
    (:mod:`fedpartial._src.engine.conv_choice`): ``"vmap"`` runs the fused round, ``"map"`` the fused round
    one client at a time (``fused:1``, a loop inside the program), ``"loop"`` a host loop of one client at a
    time, whatever the platform (with im2col on CPU, the fused round of the 8x8 digits CNN beat the loop).
    """
    if layout is not None:
        return {"vmap": fused(None), "map": fused(1)}.get(layout, stepwise(1))
    platform = platform or jax.default_backend()
    if platform == "cpu" and getattr(model, "lora", None) is not None:
        return fused(None)  # LoRA: every client's products with the shared base become one (see the docstring)
    return stepwise(1) if platform == "cpu" else fused(None)


#: clients per chunk of :func:`bounded_strategy` for a dense-only model on CPU (measured, see there)
DENSE_CPU_CHUNK = 10


def bounded_strategy(clients_that_fit: int, platform: str | None = None, model: Model | None = None) -> Strategy:
    """The streamed strategy 'auto' becomes when the whole cohort does not fit in memory, with at most
    ``clients_that_fit`` (>= 1) clients in flight (``python -m benchmarks.stream_conv``, FedAvg, 2 shared
    CPU cores; README "Bounded memory"):

    * CPU, a model with convolutions: ``stream-stepwise:1``.  CNN at K = 200 (5 steps of 16): 22.5 s a
      round, as ``stepwise:1``, where ``stream-stepwise:10`` took 118-133 s and ``stream:10`` 498-529 s
      (vmapped conv steps are slow on CPU); VGG-9 at K = 100: peak RSS 1.09 GiB against 4.47 GiB.
    * CPU, dense layers only: ``stream-stepwise:C``, C = :data:`DENSE_CPU_CHUNK`.  MLP at K = 200:
      0.6 s a round against 0.7 s for ``stepwise:1``, 0.8 s for ``stream-stepwise:1`` and 1.1 s for
      ``stream:50``; at K = 2,000 (10 steps of 32): 22-24 s as ``stepwise:1``, where chunks of 100
      took 30-33 s and ``stream:1000`` 36-40 s.
    * GPU/TPU: ``stream:C`` with the largest C that fits: the chunk runs as the fused round does.
    """
    if clients_that_fit < 1:
        raise ValueError(f"clients_that_fit {clients_that_fit} must be at least 1.")
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return streamed(clients_that_fit)
    has_conv = model is None or "conv" in model.structure.kinds
    return streamed(1 if has_conv else min(DENSE_CPU_CHUNK, clients_that_fit), stepwise=True)


def parse_strategy(text: str, model: Model | None = None, layout: str | None = None) -> Strategy:
    """'auto', 'fused', 'fused:N' (N clients vmapped at a time), 'fused-unrolled[:N]',
    'stepwise', 'stepwise:N', 'stream:N' (N clients at a time, bounded memory), 'stream-stepwise:N'
    (the same, each chunk trained step by step) or 'debug'.  'auto' is ``default_strategy`` for
    this platform, ``model`` and the measured conv ``layout``.

    Args:
      text: the ``--strategy`` value.
      model: the run's model, for ``auto`` (None: decided for the platform alone).
      layout: how ``--conv-impl auto`` measured the cohort's convolutions best laid out (``vmap``, ``map``
        or ``loop``), for ``auto``; None: the platform's rule.

    Returns:
      The :class:`~fedpartial.Strategy`.

    Raises:
      ValueError: text that is none of the above.
    """
    if text == "auto":
        return default_strategy(model=model, layout=layout)
    if text == "debug":
        return debug()
    kind, _, chunk = text.partition(":")
    streams = ("stream", "stream-stepwise")
    if kind not in ("fused", "fused-unrolled", "stepwise", *streams) or (
            chunk and not (chunk.isdigit() and int(chunk) > 0)) or (kind in streams and not chunk):
        raise ValueError(
            f"strategy {text!r} is not one of 'auto', 'fused', 'fused:N', 'fused-unrolled', "
            "'fused-unrolled:N', 'stepwise', 'stepwise:N', 'stream:N', 'stream-stepwise:N', 'debug' "
            "(N a positive number of clients)."
        )
    size = int(chunk) if chunk else None
    if kind in streams:
        return streamed(size, stepwise=kind == "stream-stepwise")
    if kind == "stepwise":
        return stepwise(size or 1)
    return fused(size, unroll=kind == "fused-unrolled")


def stream_refusal(method: Method) -> str | None:
    """Why the streamed strategy cannot run ``method`` (one clause), or None when it can."""
    if method.capabilities.streamable not in ("per_client", "summary"):
        return f"method {method.name} needs the whole cohort at once, so it cannot be streamed"
    if method.groups is not None or method.server_correct is not None or method.capabilities.needs_holdout:
        return f"method {method.name} has client groups, a server correction or held-out data, so it cannot be streamed"
    if method.rewrite_global is not None:
        return f"method {method.name} rewrites the global model from the whole cohort's uploads, so it cannot be streamed"
    if method.aggregate is not None or method.encode is not None:
        return (f"method {method.name} aggregates in its own way (not the one formula) or encodes its uploads, so it "
                "cannot be streamed")
    return None

"""FedPart (Wang, Liu, Niu, Guo & Tang, NeurIPS 2024, "Why Go Full? Elevating Federated Learning Through
Partial Network Updates"): every sampled client trains and uploads only a few layers a round.

Layers are taken in the model's :class:`~fedpartial._src.core.structure.ModelStructure` order, input to
output (*sequential updating*), in groups of ``--layers-per-round`` consecutive layers; each group is
trained for ``--rounds-per-layer`` consecutive rounds, then the next; after the output group the cycle
restarts at the input (*multi-round cycle training*).  A layer is the engine's layer: a BatchNorm goes with
the layer it follows, as the paper's code trains ``conv`` and ``bn`` together.  In a round every client
receives the whole model (the download is the whole model), trains the scheduled layers with the rest
frozen, and uploads what it trained (:func:`~fedpartial._src.methods.base.upload_trained`); the server
averages each layer over the clients that sent it with ``n_k`` weights (the engine's formula), keeping the
global value of the others.

The schedule is a pure function of the round number and the number of layers (:func:`schedule`), so the
round compiles once.  With ``G`` groups (``⌈L / layers-per-round⌉``, the last one smaller when ``L`` is not
a multiple) and ``R`` rounds per group, a *period* is ``F = --full-rounds`` full-network rounds followed by
one cycle of ``G·R`` partial rounds, and periods repeat: round ``t`` is full when ``t mod (F + G·R) < F``,
else it trains group ``(t mod (F + G·R) − F) // R``.

Decision (``--full-rounds``): the paper starts with full-network rounds and **repeats them before every
cycle** — its reference implementation (FLAIR-Community/Fling, ``partial_model_pipeline.py``, "FedPart
(Repeat)") runs 5 full rounds, one cycle, 5 full rounds, one cycle, … with 2 rounds per layer; we follow
it (an earlier version of that file ran the 5 full rounds only once, at the start).  The defaults here
(``F = 0``, ``R = 1``, one layer a round) are the plain cycle; ``--full-rounds 5 --rounds-per-layer 2`` is
the paper's setting.  ``--layers-per-round`` ≥ the number of layers (or every round full) is FedAvg.

Decision (``--train-unit block``): on a transformer a "layer" of the paper (a conv or a Dense with its norm) is
one of a block's six projections, so the plain cycle would train a block's query alone, then its key, …  With
``--train-unit block`` the unit of the schedule is the model's stage instead — ``embed``, ``block0`` …
``block{n-1}``, ``head`` for the zoo transformers (a ResNet's stages, a CNN's conv stages) — and
``--layers-per-round`` counts stages: one block a round.  Under ``--lora`` a stage's unit is its adapters
(a stage with nothing to train, the frozen embedding, is no unit).  A model of one stage is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.base import Capabilities, ClientPlan, Method, MethodContext, RoundView, make_method
from fedpartial._src.methods.layerwise.fedldf import uploads_per_client
from fedpartial._src.methods.registry import MethodSpec, Option, check_values, positive_int, whole_number

TRAIN_UNITS = ("layer", "block")


def schedule(round_, num_layers: int, layers_per_round: int = 1, rounds_per_layer: int = 1,
             full_rounds: int = 0) -> jax.Array:
    """``[L]`` bool: the layers trained in round ``round_`` (a Python int or a traced int32 scalar)."""
    groups = -(-num_layers // layers_per_round)  # ⌈L / layers_per_round⌉, static
    period = full_rounds + groups * rounds_per_layer
    phase = jnp.asarray(round_) % period
    group = (phase - full_rounds) // rounds_per_layer  # negative in the full rounds: matches no layer
    return (phase < full_rounds) | (jnp.arange(num_layers) // layers_per_round == group)


OPTIONS = (
    Option("layers_per_round", int, 1, "FedPart: consecutive layers trained together in a round (default 1)",
           positive_int),
    Option("rounds_per_layer", int, 1, "FedPart: rounds each group of layers is trained before the next "
           "(default 1; the paper's code: 2)", positive_int),
    Option("full_rounds", int, 0, "FedPart: full-network rounds before every input-to-output cycle (default 0; "
           "the paper's code: 5)", whole_number(0)),
    Option("train_unit", str, "layer", "FedPart: what one step of the cycle trains: a layer or a block (a model "
           "stage: a transformer block, a ResNet stage)", choices=TRAIN_UNITS),
)


def unit_of_layer(model, train_unit: str) -> np.ndarray:
    """Per layer of ``model.structure``, the index of its unit in the cycle (static)."""
    num_layers = model.structure.num_layers
    if train_unit == "layer":
        return np.arange(num_layers)
    stages = np.asarray(model.stage_of_layer)
    if len(np.unique(stages)) < 2:
        raise UserError(f"fedpart --train-unit block needs a model of several stages (a zoo transformer, ResNet or "
                        f"CNN), but model {model.name} has one; use --train-unit layer.")
    return np.searchsorted(np.unique(stages), stages)  # the stages that have layers, numbered in order


def fedpart(layers_per_round: int = 1, rounds_per_layer: int = 1, full_rounds: int = 0,
            train_unit: str = "layer") -> Method:
    """FedPart: the whole cohort trains and uploads the same few layers a round, cycling input to output.

    Args:
      layers_per_round: layers (or blocks) trained and uploaded each round.
      rounds_per_layer: rounds each group of layers is trained before moving on.
      full_rounds: rounds of whole-model training (FedAvg) before the cycle starts.
      train_unit: ``"layer"``: the cycle's unit is a layer; ``"block"``: a model stage (one block a round).

    Returns:
      The :class:`~fedpartial.Method` (``--method fedpart``).
    """
    check_values("fedpart", OPTIONS, layers_per_round=layers_per_round, rounds_per_layer=rounds_per_layer,
                 full_rounds=full_rounds, train_unit=train_unit)
    settings = dict(layers_per_round=int(layers_per_round), rounds_per_layer=int(rounds_per_layer),
                    full_rounds=int(full_rounds))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        k, num_layers = view.cohort.num_samples.shape[0], ctx.structure.num_layers
        unit = unit_of_layer(ctx.model, train_unit)
        layers = schedule(view.round, int(unit.max()) + 1, **settings)[unit]
        # The download stays None (the whole model): a client needs every layer to train one.
        return ClientPlan(train=masks.from_layers(ctx.structure, jnp.broadcast_to(layers, (k, num_layers))))

    # select is FedAvg's (upload what was trained, n_k weights); row k depends on client k only.
    return make_method("fedpart", plan=plan, metrics=uploads_per_client,
                       capabilities=Capabilities(streamable="per_client", asynchronous=True))


SPEC = MethodSpec("fedpart", fedpart, "Every client trains and uploads a few layers a round, cycling input to "
                                      "output, with optional full-network rounds before each cycle.", OPTIONS)

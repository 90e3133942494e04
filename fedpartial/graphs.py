"""Local graphs: how a client group sees the model during local training.

A :class:`~fedpartial.core.LocalGraph` is four pure functions.  :func:`whole` is
the default (the whole model, nothing cut).  :func:`suffix` is EmbracingFL's weak
client: stages ``[0, cut)`` are frozen and run *once per round* over the client's
whole local data (``prepare``), and every local step runs, differentiates and
updates only stages ``[cut, end)`` — its compiled step contains no prefix at all.

Any graph whose ``extract`` is a pytree selection or slice (e.g. HeteroFL's
leading channels) fits the same slot: the engine expands masks in full-model
coordinates and cuts them with ``extract``, and writes trained values back with
``insert``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from fedpartial.core import Batch, LocalGraph
from fedpartial.models.adapter import Model


def whole(model: Model) -> LocalGraph:
    """The whole model: extract and insert are the identity, no preparation."""
    return LocalGraph(extract=lambda tree: tree, insert=lambda full, part: part, apply=model.apply)


def merge_subtree(full: Any, part: Any) -> Any:
    """``full`` with every leaf present in the nested dict ``part`` replaced by ``part``'s."""
    if not isinstance(part, dict):
        return part
    out = dict(full)
    for name, sub in part.items():
        out[name] = merge_subtree(full[name], sub) if isinstance(full.get(name), dict) else sub
    return out


def suffix(model: Model, cut: int) -> LocalGraph:
    """Train stages ``[cut, end)`` only, on prefix activations prepared once per round.

    ``prepare`` runs the frozen prefix batch by batch in train mode, as a full forward
    pass of local training would (a prefix BatchNorm normalises with the batch's own
    statistics over its real examples; its running statistics are not updated, as the
    prefix is frozen), so the result equals training the whole model with the prefix
    frozen by a train mask.  ``cut == 0`` is :func:`whole`.
    """
    if not 0 <= cut < model.num_stages:
        raise ValueError(
            f"cut stage {cut} must be between 0 and {model.num_stages - 1} (model {model.name} has stages "
            f"{', '.join(model.stage_names)}).")
    if cut == 0:
        return whole(model)

    def extract(tree):
        return model.stage_variables(tree, cut)

    def prepare(variables: dict, data: Batch, batch_statistics: bool) -> Batch:
        del batch_statistics  # local training always normalises with batch statistics

        def one(x, mask):
            out, _ = model.apply_stages(variables, x, start=0, stop=cut, train=True, example_mask=mask)
            return out

        h = jax.vmap(one)(data.x, data.example_mask)  # [S, B, ...] one batch at a time
        return data._replace(x=jax.lax.stop_gradient(h))

    def apply(variables, x, train, example_mask=None):
        return model.apply_stages(variables, x, start=cut, train=train, example_mask=example_mask)

    return LocalGraph(extract=extract, insert=merge_subtree, apply=apply, prepare=prepare)


def map_inputs(graph: LocalGraph, fn: Callable[[jax.Array], jax.Array]) -> LocalGraph:
    """``graph`` fed ``fn(x)`` instead of a client's raw inputs ``x`` (e.g. the first half of every sequence).

    ``fn`` runs once per round on the client's whole local data ``[S, B, ...]``,
    before the graph's own preparation; it must act on the trailing example axes
    only and may change their shape (each client group compiles for its own).
    """

    def prepare(variables: dict, data: Batch, batch_statistics: bool) -> Batch:
        data = data._replace(x=fn(data.x))
        return data if graph.prepare is None else graph.prepare(variables, data, batch_statistics)

    return graph._replace(prepare=prepare)

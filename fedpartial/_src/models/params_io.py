"""A model's variables in a file, and a model that starts from them (``--init-from``).

The file is a numpy ``.npz`` archive: one array per leaf, named by its collection and module path joined with
``/`` (``params/block0/attn/query/kernel``, ``batch_stats/bn1/mean``), so it is readable without fedpartial
(``numpy.load``) and says which parameter is which.  :func:`save_params` writes it (a fedpartial run writes
``final_params.npz`` into its folder at its end), :func:`load_params` reads it back as the nested
``{'params': ..., 'batch_stats': ...}`` dict, and :func:`starting_from` gives a model whose initial variables
are those of the file, each checked against the model's own: the same parameters with the same shapes, or one
sentence naming the first that differs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import leaf_paths

__all__ = ["load_params", "save_params", "starting_from"]

_SEP = "/"


def save_params(variables: dict, path: str) -> str:
    """Writes a model's variables to a ``.npz`` file, one array per leaf named ``collection/module/…/leaf``.

    Args:
      variables: ``{'params': ..., 'batch_stats': ...}`` of one model (no client axis), e.g. a run's
        ``sim.state.variables``.
      path: the file (``.npz`` is added when missing); written to a temporary name and renamed into place.

    Returns:
      The path written.

    Example::

        fedpartial.models.save_params(model.init_variables(jax.random.key(0)), "start.npz")
        # fedpartial run --init-from start.npz ...
    """
    path = path if path.endswith(".npz") else path + ".npz"
    arrays = {}
    for collection, tree in variables.items():
        for leaf_path, leaf in leaf_paths(tree):
            arrays[_SEP.join((collection, *leaf_path))] = np.asarray(jax.device_get(leaf))
    partial = path[:-len(".npz")] + ".partial.npz"
    np.savez(partial, **arrays)
    os.replace(partial, path)
    return path


def load_params(path: str) -> dict:
    """The variables :func:`save_params` wrote (or a run's ``final_params.npz``), as a nested dict of arrays.

    Args:
      path: the ``.npz`` file.

    Returns:
      ``{'params': {...}, 'batch_stats': {...}}`` of numpy arrays.

    Raises:
      UserError: the file is missing or not such an archive.
    """
    if not os.path.isfile(path):
        raise UserError(f"{path} is not a file of saved parameters; give a .npz written by a fedpartial run "
                        "(final_params.npz in its folder) or by fedpartial.models.save_params.")
    try:
        with np.load(path, allow_pickle=False) as archive:
            flat = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as error:
        raise UserError(f"{path} cannot be read as saved parameters (.npz): {error}.") from None
    variables: dict = {}
    for name, array in flat.items():
        node = variables
        *parents, last = name.split(_SEP)
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = array
    return variables


def starting_from(model, variables: dict, source: str = "the saved parameters"):
    """``model`` whose ``init`` returns ``variables`` (checked against the model's own variables; cast to
    their dtypes) whatever the key: every run that initialises it starts from them.

    Raises:
      UserError: a parameter of the model missing from ``variables``, one it does not have, or a shape that
        differs, named in one sentence.
    """
    wanted = jax.eval_shape(model.init_variables, jax.random.key(0))
    found = {(c, *p): a for c, tree in variables.items() for p, a in leaf_paths(tree)}
    needed = {(c, *p): a for c, tree in wanted.items() for p, a in leaf_paths(tree)}
    for key, spec in needed.items():
        name = _SEP.join(key)
        if key not in found:
            raise UserError(f"{source} have no parameter {name} (shape {tuple(spec.shape)}), which model "
                            f"{model.name} needs; start from parameters saved by the same model.")
        if tuple(np.shape(found[key])) != tuple(spec.shape):
            raise UserError(f"{source} give parameter {name} the shape {tuple(np.shape(found[key]))}, but model "
                            f"{model.name} needs {tuple(spec.shape)}; build the same model (--model, --model-size "
                            "and the dataset's shape and classes) as the run that saved them.")
    extra = sorted(set(found) - set(needed))
    if extra:
        raise UserError(f"{source} have parameter {_SEP.join(extra[0])}, which model {model.name} does not; start "
                        "from parameters saved by the same model.")
    loaded = jax.tree.map(lambda spec, key: jnp.asarray(found[key], spec.dtype), wanted,
                          _keys_like(wanted))

    def init(key, x):
        del key, x
        return loaded

    return dataclasses.replace(model, init=init)


def _keys_like(tree: dict) -> Any:
    """``tree`` with every leaf replaced by its ``(collection, *path)`` key."""
    out = {}
    for collection, sub in tree.items():
        leaves = [(collection, *p) for p, _ in leaf_paths(sub)]
        out[collection] = jax.tree.unflatten(jax.tree.structure(sub), leaves)
    return out

"""The clients of a run and each round's cohort: the dataset a config names (its labels checked), the server's
set, the partition, every client's label counts, the cohort draw, and the cohort's data packed on the host.

Host work only (numpy); :class:`~fedpartial._src.experiment.simulation.Simulation` calls these with its
settings, and :mod:`fedpartial._src.data.ondevice` gathers the cohort's data on the device instead.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from fedpartial._src.core import types as core_types
from fedpartial._src.core.losses import IGNORED_LABEL
from fedpartial._src.core.types import CohortInfo, Holdout
from fedpartial._src.data import language, packing, sources
from fedpartial._src.data.partition import partition as split_population
from fedpartial._src.engine import sharding
from fedpartial._src.engine import types as engine_types
from fedpartial._src.experiment import config_checks, setting_checks
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.parts import labels_per_example, usual_model
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import Model


def load_dataset(config: RunConfig, viewed: bool = True) -> sources.ArrayDataset:
    """The dataset ``config`` names (the synthetic generator sized by its population settings), in the view its
    model reads (:func:`for_model`; ``viewed=False``: as loaded)."""
    options = {}
    if config.dataset == "synthetic":
        options = {"alpha": config.alpha, "beta": config.alpha, "num_clients": config.num_clients}
        if config.max_samples is not None:
            options.update(max_samples=config.max_samples, min_samples=min(50, config.max_samples))
    if config.dataset in sources.NATURAL_DATASETS:
        options = {"max_clients": config.max_clients, "min_examples": config.min_examples,
                   "num_clients": config.num_clients}
        options.update({"task": config.leaf_task} if config.dataset == "leaf" else
                       {"client_column": config.client_column, "feature": config.feature, "label": config.label})
    loaded = sources.load_dataset(config.dataset, data_dir=config.data_dir, seed=config.seed, **options)
    return for_model(config, loaded) if viewed else loaded


def for_model(config: RunConfig, dataset: sources.ArrayDataset, model: Model | None = None) -> sources.ArrayDataset:
    """``dataset`` as the run's model reads it: next-character data (LEAF's or a Hugging Face Shakespeare)
    with a label per position for a language model (:func:`~fedpartial._src.data.language.next_token_view`),
    anything else as it is.  The model is the caller's ``model`` (a language model when its logits are per
    position), else the config's (its registry entry says); a language model the config names on labels that
    are not next tokens is refused in one sentence (a caller's model is checked when the run is built)."""
    if model is not None:
        if dataset.label_token_offset is None or np.ndim(dataset.y_train) > 1 or \
                not labels_per_example(model, dataset.x_train.dtype):
            return dataset
        return language.next_token_view(dataset)
    usual = usual_model(dataset)
    name = usual if config.model == "auto" else config.model
    if not registry.find_model(name).language_model or np.ndim(dataset.y_train) > 1:
        return dataset
    if dataset.label_token_offset is None:
        raise ConfigError(f"--model {name} is a language model (a next token at every position), but the labels of "
                          f"{dataset.name} are one class per example, not the token that follows; choose a "
                          f"classifier such as {usual}, or next-character data (LEAF's or a Hugging Face "
                          "Shakespeare) or synthetic_lm for the language model.")
    return language.next_token_view(dataset)


def with_population(config: RunConfig, dataset: sources.ArrayDataset) -> RunConfig:
    """``config`` with ``--clients`` left open (leaf, hf) set to the clients ``dataset`` brings; what depends on
    the population's size is checked (:func:`~fedpartial._src.experiment.setting_checks.check_population`), the
    rest was when ``config`` was validated."""
    if config.num_clients is not None or dataset.natural_partition is None:
        return config
    populated = dataclasses.replace(config, num_clients=len(dataset.natural_partition))
    setting_checks.check_population(populated)
    return config_checks.with_validation(populated, config)


def run_dataset(config: RunConfig, dataset: sources.ArrayDataset | None = None,
                model: Model | None = None) -> tuple[RunConfig, sources.ArrayDataset]:
    """A run's training and test data and its configuration with the population known: the caller's ``dataset``,
    else the one ``config`` names, in the view the run's model (the caller's ``model``, else the config's) reads
    (a language model: labels per position); leaf and hf take ``--clients`` from the files.  Labels are checked
    before the partition counts them."""
    if dataset is None and model is None:
        dataset = load_dataset(config)
    else:
        dataset = for_model(config, dataset if dataset is not None else load_dataset(config, viewed=False), model)
    config = with_population(config, dataset)
    check_labels(dataset)
    return config, dataset


def check_labels(dataset: sources.ArrayDataset) -> None:
    """Every label of ``dataset`` is a class it declares (``0 … num_classes − 1``): else one sentence."""
    for split, y in (("training", dataset.y_train), ("test", dataset.y_test)):
        y = np.asarray(y)
        if y.ndim > 1:  # labels per position: IGNORED_LABEL (-1) marks a position with nothing to predict
            y = y[y != IGNORED_LABEL]
        if y.size and (y.min() < 0 or y.max() >= dataset.num_classes):
            bad = int(y.min()) if y.min() < 0 else int(y.max())
            raise ConfigError(f"{dataset.name}'s {split} labels include {bad}, but it declares {dataset.num_classes} "
                              f"classes (labels 0 to {dataset.num_classes - 1}); fix the labels or num_classes.")


def server_examples(y: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """``per_class`` training indices of every class, drawn with ``seed`` (a class-balanced server set)."""
    rng = np.random.default_rng([seed, 0x5E7])
    picked = []
    for c in np.unique(y):
        of_class = np.flatnonzero(y == c)
        if len(of_class) <= per_class:
            raise ConfigError(f"the server set needs {per_class} examples of class {int(c)} and more left for "
                              f"clients, but the training data has only {len(of_class)}.")
        picked.append(rng.choice(of_class, per_class, replace=False))
    return np.sort(np.concatenate(picked))


def partition_clients(config: RunConfig, dataset: sources.ArrayDataset, train_fraction: float = 1.0,
                      pool: np.ndarray | None = None) -> list[np.ndarray]:
    """Every client's training indices.  ``pool`` limits the examples clients may get
    (the rest is the server's); a natural partition is taken as it is."""
    if config.partition == "natural" or dataset.natural_partition is not None:
        if dataset.natural_partition is None:
            raise ConfigError(f"dataset {dataset.name!r} has no natural partition; use iid, dirichlet or shards.")
        parts = list(dataset.natural_partition)
        if len(parts) != config.num_clients:
            raise ConfigError(
                f"dataset {dataset.name!r} is partitioned into {len(parts)} clients by nature, "
                f"but {config.num_clients} clients were asked for."
            )
        return parts
    options = {"dirichlet": {"alpha": config.alpha}, "shards": {"classes_per_client": config.classes_per_client}}
    # A held-out split needs two examples per client: one to train on, one to hold out.
    pool = np.arange(len(dataset.y_train)) if pool is None else pool
    min_size = 2 if train_fraction < 1 and 2 * config.num_clients <= len(pool) else 1
    parts = split_population(dataset.groups[pool], config.num_clients, config.partition, seed=config.seed,
                             min_size=min_size, **options.get(config.partition, {}))
    return [pool[p] for p in parts]


def label_counts(y: np.ndarray, clients: list[np.ndarray], num_classes: int) -> np.ndarray:
    """``[N, C]`` every client's training labels per class (FedDH's label distributions): its examples', or
    with labels per position its sequences' real targets."""
    # One bincount over (client, label) pairs: no per-client Python work for a million clients.
    sizes = np.array([len(c) for c in clients])
    owner = np.repeat(np.arange(len(clients)), sizes)
    labels = y[np.concatenate(clients)] if sizes.sum() else np.zeros((0, *np.shape(y)[1:]), np.int64)
    if labels.ndim > 1:
        owner = np.repeat(owner, int(np.prod(labels.shape[1:])))
        labels = labels.reshape(-1)
        owner, labels = owner[labels >= 0], labels[labels >= 0]
    return np.bincount(owner * num_classes + labels, minlength=len(clients) * num_classes).reshape(
        len(clients), -1).astype(np.float32)


def _draw(key: jax.Array, members: np.ndarray, active: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` of ``members`` uniformly among the active ones (sorted ids, and which are real)."""
    if active.all():
        picked = _distinct_uniform(key, len(members), k)
        return np.sort(members[picked]), np.ones(k, bool)
    pool = members[active]
    if len(pool) >= k:
        # Gumbel top-k over the active members: the shapes never change, so nothing
        # recompiles as the pool shrinks.
        scores = np.where(active, np.asarray(jax.random.gumbel(key, (len(members),))), -np.inf)
        return np.sort(members[np.argsort(-scores, kind="stable")[:k]]), np.ones(k, bool)
    filler = members[~active][: k - len(pool)]
    return np.concatenate([pool, filler]), np.arange(k) < len(pool)


# Up to this many members a draw permutes them all (as every run before the O(k) draw did, so their cohorts
# are unchanged); above it, Floyd's algorithm draws k of n in O(k) (a 1M-client permutation took 0.7 s a round).
_PERMUTATION_MAX = 1 << 16


def _distinct_uniform(key: jax.Array, n: int, k: int) -> np.ndarray:
    """``k`` distinct positions of ``range(n)``, every k-subset equally likely (order not meaningful)."""
    if n <= _PERMUTATION_MAX:
        return np.asarray(jax.random.choice(key, n, (k,), replace=False))
    # Floyd: for j = n-k .. n-1 draw t uniform in [0, j]; take t, or j itself when t is already taken.  Every
    # k-subset comes out with probability 1 / C(n, k); the work and memory are O(k), whatever n is.
    tops = np.arange(n - k, n, dtype=np.int64)
    draws = np.asarray(jax.random.randint(key, (k,), 0, tops + 1))  # int32: client ids are int32 everywhere
    taken: set[int] = set()
    for top, t in zip(tops.tolist(), draws.tolist()):
        taken.add(top if t in taken else t)
    return np.fromiter(taken, np.int64, count=k)


def round_keys(rounds_key: jax.Array, t: int) -> jax.Array:
    """Round ``t``'s three keys from ``rounds_key``: the draw's, the round's and the packing's."""
    return jax.random.split(jax.random.fold_in(rounds_key, t), 3)


def sample_cohort(rounds_key: jax.Array, t: int, active: np.ndarray, groups, *, num_clients: int,
                  cohort_size: int, padded_size: int) -> tuple[np.ndarray, np.ndarray, jax.Array, int]:
    """Round ``t``'s client ids, which are real, the round key and packing seed — all from ``rounds_key``.

    The cohort is laid out group by group (``groups``: one group of ``cohort_size`` unless the method
    has client groups); each group draws its fixed number of clients from its ``active`` members
    (stratified).  When fewer are active, all of them take part and the group's slots are filled with
    inactive members marked not valid (they train on nothing and weigh nothing).  A cohort split over
    devices ends with padding clients up to ``padded_size`` (ids outside the cohort, not valid); the
    draw is the same as on one device.
    """
    sample_key, round_key, pack_key = round_keys(rounds_key, t)
    ids, valid = [], []
    extra = padded_size - cohort_size  # padding slots, at the end
    for g, group in enumerate(groups):
        members = np.arange(len(active)) if group.members is None else np.asarray(group.members)
        key = sample_key if len(groups) == 1 else jax.random.fold_in(sample_key, g)
        chosen, real = _draw(key, members, active[members], group.size - (extra if g == len(groups) - 1 else 0))
        ids.append(chosen)
        valid.append(real)
    pack_seed = int(jax.random.randint(pack_key, (), 0, np.iinfo(np.int32).max))
    ids, valid = np.concatenate(ids), np.concatenate(valid)
    if extra:
        ids = np.concatenate([ids, sharding.padding_ids(ids, num_clients, extra)])
        valid = np.concatenate([valid, np.zeros(extra, bool)])
    return ids, valid, round_key, pack_seed


def packed_cohort(dataset: sources.ArrayDataset, clients: list[np.ndarray], holdout: tuple | None,
                  ids: np.ndarray, valid: np.ndarray, pack_seed: int, *, batch_size: int, num_steps: int,
                  local_steps: int | None, local_epochs: float | None) -> engine_types.Cohort:
    """The clients ``ids``' local data for one round, packed on the host and shuffled with ``pack_seed``
    (a client not ``valid`` gets none)."""
    empty = np.zeros(0, np.int64)
    packed = packing.pack_cohort(
        dataset.x_train, dataset.y_train, [clients[i] if v else empty for i, v in zip(ids, valid)],
        batch_size=batch_size, num_steps=num_steps, local_steps=local_steps, local_epochs=local_epochs,
        seed=pack_seed,
    )
    return engine_types.cohort_from_packed(packed, ids, valid, _cohort_holdout(holdout, ids, valid))


def streamed_cohort(dataset: sources.ArrayDataset, clients: list[np.ndarray], sizes: np.ndarray,
                    holdout: tuple | None, ids: np.ndarray, valid: np.ndarray, pack_seed: int, *,
                    batch_size: int, num_steps: int, local_steps: int | None,
                    local_epochs: float | None) -> engine_types.Cohort:
    """The cohort with its data packed a chunk at a time (:class:`engine_types.ClientData`): each client's
    batches come from its own seed ``(pack_seed, id)``, so they do not depend on its chunk."""
    empty = np.zeros(0, np.int64)
    x, y = dataset.x_train, dataset.y_train

    def take(rows):
        packed = packing.pack_cohort(
            x, y, [clients[i] if v else empty for i, v in zip(ids[rows], valid[rows])],
            batch_size=batch_size, num_steps=num_steps, local_steps=local_steps,
            local_epochs=local_epochs, seed=pack_seed, client_keys=ids[rows])
        return engine_types.cohort_from_packed(packed, ids[rows]).data

    k, s, b = len(ids), num_steps, batch_size
    x_dtype = x.dtype if np.issubdtype(x.dtype, np.integer) else np.dtype(np.float32)
    spec = core_types.Batch(jax.ShapeDtypeStruct((k, s, b, *x.shape[1:]), x_dtype),
                        jax.ShapeDtypeStruct((k, s, b), np.int32), jax.ShapeDtypeStruct((k, s, b), bool),
                        jax.ShapeDtypeStruct((k, s), bool))
    client_sizes = np.where(valid, sizes[ids], 0).astype(np.float32)
    cohort = engine_types.Cohort(engine_types.ClientData(take, spec), CohortInfo(np.asarray(ids, np.int32), client_sizes,
                                                                     np.asarray(valid, bool)))
    if holdout is not None:
        cohort = cohort._replace(holdout=_cohort_holdout(holdout, ids, valid))
    return cohort


def _cohort_holdout(holdout: tuple | None, ids: np.ndarray, valid: np.ndarray) -> Holdout | None:
    """The cohort's rows of the padded holdout, a client not ``valid`` holding none out."""
    if holdout is None:
        return None
    x, y, mask = holdout
    return Holdout(x[ids], y[ids], mask[ids] & valid[:, None])

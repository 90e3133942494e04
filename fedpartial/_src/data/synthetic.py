"""Synthetic(alpha, beta): the federated benchmark of the FedProx paper.

Li et al. 2020, "Federated Optimization in Heterogeneous Networks", section 5.1.
Every client k has its own softmax-regression teacher and its own feature
distribution; features are 60-dimensional and there are 10 classes::

    u_k ~ N(0, alpha)          B_k ~ N(0, beta)
    W_k ~ N(u_k, 1)  [10, 60]  v_k ~ N(B_k, 1)  [60]
    b_k ~ N(u_k, 1)  [10]      x   ~ N(v_k, Sigma),  Sigma = diag(j ** -1.2), j = 1..60
    y = argmax(softmax(W_k x + b_k)) = argmax(W_k x + b_k)

``alpha`` controls how much the teachers differ between clients, ``beta`` how
much the feature distributions differ. Decisions taken here:

* ``N(0, alpha)`` is read with ``alpha`` as the *standard deviation* (as in the
  generator the FedProx authors released), so Synthetic(0.5, 0.5) here matches
  the data used in the literature; for alpha = beta = 1 both readings agree.
* ``iid=True`` is the paper's Synthetic-IID: one W, b (entries N(0, 1)) shared
  by all clients, v_k = 0; alpha and beta are then unused.
* Client sizes follow a lognormal power law:
  ``n_k = min_samples + floor(LogNormal(mean=4, sigma=2))``, optionally capped at
  ``max_samples`` (the heavy tail gives a few clients thousands of examples).
* Each client's examples are split into a held-out part of
  ``round(test_fraction * n_k)`` examples (at most ``n_k - 1``, so every client
  keeps at least one training example) and a training part.
* Randomness: ``numpy.random.SeedSequence(seed)`` is spawned into one stream for
  the sizes (and the shared teacher of the IID variant) and one stream per
  client, so a client's data does not depend on how the others were drawn.

The returned :class:`ArrayDataset` stores the clients' training parts one after
the other in ``x_train`` (client 0 first) and their held-out parts likewise in
``x_test``; ``natural_partition[k]`` / ``natural_test_partition[k]`` are the
(contiguous, sorted, int64) index ranges of client k in those arrays.
"""

from __future__ import annotations

import math

import numpy as np

from fedpartial._src.data.arrays import ArrayDataset, DataError

__all__ = ["make_synthetic", "client_sizes", "expected_examples", "NUM_FEATURES", "NUM_CLASSES",
           "GENERATION_BYTES_PER_EXAMPLE"]

NUM_FEATURES = 60
NUM_CLASSES = 10
#: host bytes per drawn example at the generator's peak: its float32 features and int32 label, twice (each
#: client's draw, then the arrays every client's are joined into; measured 222-230 KB a client at 463 examples)
GENERATION_BYTES_PER_EXAMPLE = 2 * (NUM_FEATURES * 4 + 4)
#: the client-size law's lognormal (mean, sigma) of the underlying normal
_SIZE_LOG_MEAN, _SIZE_LOG_SIGMA = 4.0, 2.0


def expected_examples(num_clients: int, *, min_samples: int = 50, max_samples: int | None = None) -> float:
    """The expected number of examples (both splits) :func:`make_synthetic` draws for ``num_clients``
    clients: ``min_samples + E[min(floor(LogNormal), max_samples - min_samples)]`` each, computed before
    anything is drawn (so a population too large to generate is refused up front)."""
    mu, sigma = _SIZE_LOG_MEAN, _SIZE_LOG_SIGMA
    mean = math.exp(mu + sigma**2 / 2)
    if max_samples is not None:  # E[min(X, a)] of a lognormal X
        a = max(max_samples - min_samples, 0)
        if a == 0:
            return float(num_clients * min(min_samples, max_samples))
        phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
        mean = mean * phi((math.log(a) - mu - sigma**2) / sigma) + a * (1 - phi((math.log(a) - mu) / sigma))
    return num_clients * (min_samples + max(mean - 0.5, 0.0))  # floor takes half an example on average


def client_sizes(rng: np.random.Generator, num_clients: int, *, min_samples: int = 50,
                 max_samples: int | None = None) -> np.ndarray:
    """``[num_clients]`` int64 client sizes (both splits) drawn from ``rng``: the first draw of
    :func:`make_synthetic`'s shared stream, so a seed's sizes can be had without generating its data."""
    sizes = min_samples + np.floor(rng.lognormal(mean=_SIZE_LOG_MEAN, sigma=_SIZE_LOG_SIGMA, size=num_clients))
    if max_samples is not None:
        sizes = np.minimum(sizes, max_samples)
    return sizes.astype(np.int64)


def make_synthetic(
    alpha: float,
    beta: float,
    num_clients: int,
    *,
    seed: int,
    iid: bool = False,
    min_samples: int = 50,
    max_samples: int | None = None,
    test_fraction: float = 0.2,
) -> ArrayDataset:
    """Generate Synthetic(alpha, beta) with ``num_clients`` clients (see module doc).

    Args:
      alpha: how much the clients' models differ.
      beta: how much the clients' inputs differ.
      num_clients: the population.
      seed: the generator's seed.
      iid: one model and input distribution for every client.
      min_samples: the fewest examples a client has.
      max_samples: the most (None: no bound).
      test_fraction: each client's share of examples in the test split.

    Returns:
      The :class:`~fedpartial.data.ArrayDataset`, with its natural partition.
    """
    _validate(alpha, beta, num_clients, min_samples, max_samples, test_fraction)
    seq = np.random.SeedSequence(int(seed))
    shared_seq, *client_seqs = seq.spawn(num_clients + 1)
    shared = np.random.default_rng(shared_seq)

    sizes = client_sizes(shared, num_clients, min_samples=min_samples, max_samples=max_samples)
    if iid:
        w_shared = shared.normal(0.0, 1.0, size=(NUM_CLASSES, NUM_FEATURES))
        b_shared = shared.normal(0.0, 1.0, size=NUM_CLASSES)

    # Sigma_jj = j ** -1.2, so the standard deviation of feature j is j ** -0.6.
    feature_std = np.arange(1, NUM_FEATURES + 1, dtype=np.float64) ** -0.6

    xs_train, ys_train, xs_test, ys_test = [], [], [], []
    for n_k, client_seq in zip(sizes, client_seqs):
        rng = np.random.default_rng(client_seq)
        if iid:
            w, b = w_shared, b_shared
            v = np.zeros(NUM_FEATURES)
        else:
            u = rng.normal(0.0, alpha)
            w = rng.normal(u, 1.0, size=(NUM_CLASSES, NUM_FEATURES))
            b = rng.normal(u, 1.0, size=NUM_CLASSES)
            big_b = rng.normal(0.0, beta)
            v = rng.normal(big_b, 1.0, size=NUM_FEATURES)
        x = (v + rng.standard_normal((int(n_k), NUM_FEATURES)) * feature_std).astype(np.float32)
        # Labels from the stored (float32) features, so they agree with what a model sees.
        y = np.argmax(x.astype(np.float64) @ w.T + b, axis=1).astype(np.int32)
        n_test = min(int(n_k) - 1, int(math.floor(test_fraction * n_k + 0.5)))
        n_train = int(n_k) - n_test
        xs_train.append(x[:n_train])
        ys_train.append(y[:n_train])
        xs_test.append(x[n_train:])
        ys_test.append(y[n_train:])

    def ranges(parts: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        ends = np.cumsum([len(p) for p in parts])
        starts = ends - [len(p) for p in parts]
        return tuple(np.arange(s, e, dtype=np.int64) for s, e in zip(starts, ends))

    name = "synthetic_iid" if iid else f"synthetic({alpha:g},{beta:g})"
    return ArrayDataset(
        name=name,
        x_train=np.concatenate(xs_train),
        y_train=np.concatenate(ys_train),
        x_test=np.concatenate(xs_test).reshape(-1, NUM_FEATURES),
        y_test=np.concatenate(ys_test),
        num_classes=NUM_CLASSES,
        natural_partition=ranges(xs_train),
        natural_test_partition=ranges(xs_test),
    )


def _validate(alpha, beta, num_clients, min_samples, max_samples, test_fraction) -> None:
    for label, value in (("alpha", alpha), ("beta", beta)):
        if not isinstance(value, (int, float, np.integer, np.floating)) or not (
            math.isfinite(value) and value >= 0
        ):
            raise DataError(
                f"Synthetic {label}={value!r} is not allowed; it must be a finite number >= 0."
            )
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise DataError(
            f"Synthetic num_clients={num_clients!r} is not allowed; it must be an integer >= 1."
        )
    if not isinstance(min_samples, (int, np.integer)) or min_samples < 1:
        raise DataError(
            f"Synthetic min_samples={min_samples!r} is not allowed; it must be an integer >= 1."
        )
    if max_samples is not None and (
        not isinstance(max_samples, (int, np.integer)) or max_samples < min_samples
    ):
        raise DataError(
            f"Synthetic max_samples={max_samples!r} is not allowed; it must be None or an "
            f"integer >= min_samples ({min_samples})."
        )
    if not isinstance(test_fraction, (int, float)) or not 0.0 <= test_fraction < 1.0:
        raise DataError(
            f"Synthetic test_fraction={test_fraction!r} is not allowed; it must lie in [0, 1)."
        )

"""Evaluation: padding of the last batch changes nothing; the static-BN path uses batch statistics."""

import jax
import numpy as np

from fedpartial._src.experiment.evaluation import evaluate


def test_batch_size_does_not_change_the_result(mlp):
    v = mlp.init_variables(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(23, 4)).astype(np.float32)
    y = rng.integers(0, 3, 23).astype(np.int32)
    a = evaluate(mlp, v, x, y, batch_size=7)  # 3 full batches + one padded batch of 2
    b = evaluate(mlp, v, x, y, batch_size=64)
    np.testing.assert_allclose(a["accuracy"], b["accuracy"])
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)  # GPU matmuls default to TF32
    logits, _ = mlp.apply(v, x, False)
    assert a["accuracy"] == np.mean(np.argmax(logits, -1) == y)


def test_static_policy_normalises_with_batch_statistics(mlp):
    v = mlp.init_variables(jax.random.key(0))
    x = np.random.default_rng(1).normal(5.0, 3.0, size=(16, 4)).astype(np.float32)
    y = np.zeros(16, np.int32)
    running = evaluate(mlp, v, x, y)
    batch = evaluate(mlp, v, x, y, batch_statistics=True)
    logits, _ = mlp.apply(v, x, True)
    expected = -np.mean(jax.nn.log_softmax(logits)[:, 0])
    np.testing.assert_allclose(batch["loss"], expected, rtol=1e-5)
    assert not np.isclose(running["loss"], batch["loss"])


def _holdouts(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)) for n in sizes]


def test_every_client_is_evaluated_with_its_own_model_and_sub_model(mlp):
    from fedpartial._src.core import masks
    from fedpartial._src.experiment.evaluation import evaluate_clients, pad_holdouts
    from fedpartial._src.methods.base import PersonalModels

    sizes = [5, 0, 3, 7, 1]
    parts = _holdouts(sizes)
    x, y, mask = pad_holdouts(parts)
    assert x.shape == (5, 7, 4) and mask.sum(1).tolist() == sizes
    models = [mlp.init_variables(jax.random.key(i)) for i in range(5)]
    stacked = jax.tree.map(lambda *a: np.stack(a), *models)
    keep = [np.array([1, 1, 0, 1, 0, 1], bool), np.ones(5, bool), np.ones(3, bool)]
    submodel = masks.from_neurons(mlp.structure, [np.stack([k] * 5) for k in keep])
    personal = PersonalModels(variables=stacked, submodel=submodel)
    results = [evaluate_clients(mlp, personal, x, y, mask, chunk_size=c, client_loop=loop)
               for c in (None, 1, 2, 5) for loop in ("map", "vmap")]
    for i, (xi, yi) in enumerate(parts):
        if not len(yi):
            assert np.isnan(results[0]["accuracy"][i])
            continue
        params = jax.tree.map(np.multiply, models[i]["params"],
                              masks.submodel_scale(mlp.structure, jax.tree.map(lambda a: a[i], submodel),
                                                   models[i]["params"]))
        want = evaluate(mlp, {**models[i], "params": params}, xi, yi)
        for r in results:  # chunks of 1, 2 (the last overlapping), all clients and the default; both loops
            np.testing.assert_allclose(r["accuracy"][i], want["accuracy"])
            np.testing.assert_allclose(r["loss"][i], want["loss"], rtol=1e-5)
    acc = results[0]["accuracy"]
    assert results[0]["mean"] == np.nanmean(acc) and results[0]["min"] == np.nanmin(acc)
    assert np.isclose(results[0]["std"], np.nanstd(acc))


def test_one_shared_model_on_every_clients_data(mlp):
    from fedpartial._src.experiment.evaluation import evaluate_clients, pad_holdouts
    from fedpartial._src.methods.base import PersonalModels

    parts = _holdouts([4, 6, 2], seed=3)
    v = mlp.init_variables(jax.random.key(0))
    shared = PersonalModels(variables=v, stacked=False)
    pooled = evaluate(mlp, v, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    for chunk in (None, 1, 2):  # one flat batch of every client's examples, or of each chunk's
        r = evaluate_clients(mlp, shared, *pad_holdouts(parts), chunk_size=chunk)
        np.testing.assert_allclose(r["pooled"], pooled["accuracy"])
        for i, (xi, yi) in enumerate(parts):
            want = evaluate(mlp, v, xi, yi)
            np.testing.assert_allclose(r["accuracy"][i], want["accuracy"])
            np.testing.assert_allclose(r["loss"][i], want["loss"], rtol=1e-5)
    # 'static' BatchNorm: each client's examples are normalised with their own statistics, not the batch's.
    r = evaluate_clients(mlp, shared, *pad_holdouts(parts), batch_statistics=True)
    for i, (xi, yi) in enumerate(parts):
        want = evaluate(mlp, v, xi, yi, batch_statistics=True)
        np.testing.assert_allclose(r["loss"][i], want["loss"], rtol=1e-5)


def test_chunks_are_bounded_by_bytes_and_examples_on_every_platform(monkeypatch):
    """A population far larger than memory is evaluated in bounded chunks: CPU maps over at most 64 personal
    models (or a 512-example flat batch of a shared model); an accelerator vmaps at most 8,192 examples and an
    eighth of its free memory."""
    from fedpartial._src.experiment import evaluation
    from fedpartial._src.methods.base import PersonalModels

    n, h = 100_000, 10
    lazy = lambda shape, dtype: np.broadcast_to(np.zeros((), dtype), shape)  # noqa: E731 - sized, not allocated
    x, y = lazy((n, h, 60), np.float32), lazy((n, h), np.int32)
    big = PersonalModels(variables={"w": lazy((n, 1_000_000), np.float32)})  # 4 MB per client
    shared = PersonalModels(variables={"w": np.zeros(250_000, np.float32)}, stacked=False)
    monkeypatch.setattr(evaluation.jax, "default_backend", lambda: "cpu")
    assert evaluation._client_loop_and_chunk(big, x, y, n) == ("map", evaluation.CHUNK_BYTES_CPU // 4_002_440)
    assert evaluation._client_loop_and_chunk(shared, x, y, n) == ("map", 512 // h)
    monkeypatch.setattr(evaluation.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(evaluation.memory, "available_bytes", lambda: (800 * 2**20, "GPU memory"))
    assert evaluation._client_loop_and_chunk(big, x, y, n) == ("vmap", 100 * 2**20 // 4_002_440)
    assert evaluation._client_loop_and_chunk(shared, x, y, n) == ("vmap", 8192 // h)

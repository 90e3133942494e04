# %% [markdown]
# # Writing a method for fedpartial
#
# A method is a NamedTuple of small pure functions run by one generic round
# (`help(fedpartial.Method)` lists them all; `fedpartial.make_method` fills every piece you leave
# out with FedAvg's).  Everything below comes from the public API: `fedpartial` and `fedpartial.masks`.
#
# ```
# init          (once)        (ctx, InitView)           -> MethodState   the method's own state
# plan          (cohort)      (ctx, RoundView)          -> ClientPlan    what each client trains / keeps / receives
# client_start  (one client)  (ctx, global, state, plan) -> variables    where local training starts
# step_plan     (one step)    (ctx, plan, key, step)    -> ClientPlan    e.g. dropout resampled every step
# objective     (one step)    (ctx, params, LocalStep)  -> (loss, aux)   the local objective
# transform_grads (one step)  (ctx, grads, LocalStep)   -> grads         e.g. a control-variate correction
# select        (cohort)      (ctx, RoundView)          -> Selection     upload masks, weights, extra bytes
# update        (cohort)      (ctx, RoundView)          -> MethodState
# metrics       (cohort)      (ctx, RoundView)          -> {name: array} per-round values for metrics.jsonl
# ```
#
# This example builds **"RandomLayers"**: every round each client uploads a random
# half of the layers, and the server keeps, per client, how many times it has
# uploaded each layer (per-client state for the whole population, `[N, L]`).  A
# `metrics` hook reports how many layers each client uploaded.  `Simulation` takes
# the method object itself, so it gets sampling, evaluation and logging like any
# registered method.  It runs on the offline digits data in a few seconds:
# `python notebooks/custom_method.py`.

# %%
import jax
import jax.numpy as jnp

import fedpartial as fp
from fedpartial import masks


def random_layers(fraction: float = 0.5):
    def init(ctx, view):
        # Per-client state: a row per client of the population.
        counts = jnp.zeros((ctx.num_clients, ctx.structure.num_layers), jnp.int32)
        return fp.MethodState(server=(), clients=counts)

    def select(ctx, view):
        k, num_layers = view.cohort.client_ids.shape[0], ctx.structure.num_layers
        n_up = max(1, round(fraction * num_layers))  # static: decided by Python numbers only
        # Random scores → top-n layers per client, as a mask (never a variable-size gather).
        # view.key is select's own key: plan, update and metrics each get a different one.
        scores = jax.random.uniform(view.key, (k, num_layers))
        threshold = jnp.sort(scores, axis=1)[:, num_layers - n_up][:, None]
        layers = scores >= threshold
        return fp.Selection(
            upload=masks.from_layers(ctx.structure, layers),
            weights=view.cohort.num_samples,
            extra_upload_bytes=jnp.full((k,), 4 * num_layers, jnp.int32),  # say which layers: L int32
        )

    def update(ctx, view):
        uploaded = view.selection.upload.layers.astype(jnp.int32)
        rows = view.client_state + uploaded
        clients = fp.scatter_clients(view.method_state.clients, fp.cohort_rows(view), rows, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def metrics(ctx, view):
        return {"layers_uploaded": jnp.sum(view.selection.upload.layers, axis=1)}

    return fp.make_method("random-layers", init=init, select=select, update=update, metrics=metrics)


# %% Plug it into the host driver and run a few rounds on digits.
def main():
    config = fp.RunConfig(rounds=5, num_clients=20, cohort_size=5, local_epochs=1, out_dir=None)
    sim = fp.Simulation(config, method=random_layers(0.5))
    print(sim.model.structure.describe())
    for record in sim.rounds():
        print(f"round {record['round']}: accuracy {record['test_accuracy']:.3f}, "
              f"uploaded {record['upload_bytes'] / 1e3:.1f} kB, layers per client {record['layers_uploaded']}")

    counts = sim.state.method_state.clients
    print("uploads per client and layer:\n", counts)
    # Every sampled client uploaded exactly half of the layers each time it was sampled.
    assert int(counts.sum()) == config.rounds * config.cohort_size * round(0.5 * sim.model.structure.num_layers)


if __name__ == "__main__":  # the contract test imports random_layers without running this
    main()

# %% [markdown]
# # Writing a method for fedpartial
#
# A method is a NamedTuple of small pure functions run by one generic round:
#
# ```
# plan         (cohort)     -> ClientPlan   what each client trains / keeps / receives
# client_start (one client) -> variables    where local training starts
# regularizer  (one client) -> scalar       extra term of the local objective
# select       (cohort)     -> Selection    upload masks, weights, extra bytes
# update       (cohort)     -> MethodState  the method's own state
# ```
#
# This example builds **"RandomLayers"**: every round each client uploads a random
# half of the layers, and the server keeps, per client, how many times it has
# uploaded each layer (per-client state for the whole population, `[N, L]`).
# It runs on the offline digits data in a few seconds:
# `python notebooks/custom_method.py`.

# %%
import jax
import jax.numpy as jnp
import optax

from fedpartial import engine, masks
from fedpartial.methods import MethodState, Selection, make_method, scatter_clients
from fedpartial.simulation import RunConfig, Simulation


def random_layers(fraction: float = 0.5):
    def init(ctx, global_vars):
        # Per-client state: a row per client of the population.
        counts = jnp.zeros((ctx.num_clients, ctx.structure.num_layers), jnp.int32)
        return MethodState(server=(), clients=counts)

    def select(ctx, view):
        k, num_layers = view.cohort.client_ids.shape[0], ctx.structure.num_layers
        n_up = max(1, round(fraction * num_layers))  # static: decided by Python numbers only
        # Random scores → top-n layers per client, as a mask (never a variable-size gather).
        scores = jax.random.uniform(view.key, (k, num_layers))
        threshold = jnp.sort(scores, axis=1)[:, num_layers - n_up][:, None]
        layers = scores >= threshold
        return Selection(
            upload=masks.from_layers(ctx.structure, layers),
            weights=view.cohort.num_samples,
            extra_upload_bytes=jnp.full((k,), 4 * num_layers, jnp.int32),  # say which layers: L int32
        )

    def update(ctx, view):
        uploaded = view.selection.upload.layers.astype(jnp.int32)
        rows = view.client_state + uploaded
        clients = scatter_clients(view.method_state.clients, view.cohort.client_ids, rows, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    return make_method("random-layers", init=init, select=select, update=update)


# %% Plug it into the host driver and run a few rounds on digits.
config = RunConfig(rounds=5, num_clients=20, cohort_size=5, local_epochs=1, out_dir=None)
sim = Simulation(config)
sim.round = engine.FederatedRound(
    sim.model, random_layers(0.5), num_clients=config.num_clients, cohort_size=config.cohort_size,
    client_optimizer=optax.sgd(0.05, momentum=0.9),
)
sim.state = sim.round.init(jax.random.key(0))
print(sim.model.structure.describe())
for record in sim.rounds():
    print(f"round {record['round']}: accuracy {record['test_accuracy']:.3f}, "
          f"uploaded {record['upload_bytes'] / 1e3:.1f} kB")

counts = sim.state.method_state.clients
print("uploads per client and layer:\n", counts)
# Every sampled client uploaded exactly half of the layers each time it was sampled.
assert int(counts.sum()) == config.rounds * config.cohort_size * round(0.5 * sim.model.structure.num_layers)

"""The one composition rule: every hook of a wrapped method sees its own part of the state, whatever the hook,
wrappers nest, and a combination a wrapper declares it cannot take is one sentence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core import aggregation
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Carry, Method, MethodState, client_sgd
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise, streamed
from fedpartial._src.methods import base
from fedpartial._src.methods.basic.fednova import fednova
from fedpartial._src.methods.basic.scaffold import control_variates
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from fedpartial._src.methods.tiered.embracingfl import embracingfl
from fedpartial._src.methods.wrappers import HOOK_KINDS, NOT_HOOKS, Wrapper, wrap
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N, K = 5, 3


def test_the_rule_covers_every_hook_of_a_method():
    """A hook added to Method without saying where it reads state would be passed through unprojected."""
    assert set(HOOK_KINDS) | set(NOT_HOOKS) == set(Method._fields)


def _where_state_is(kind, args):
    """The (server, clients) a hook's arguments carry, by the hook's kind."""
    if kind in ("view", "update"):
        return args[1].method_state.server, args[1].client_state
    if kind == "step":
        return args[2].server_state, args[2].client_state
    if kind == "state":
        return args[1].server, args[1].clients
    if kind == "rows":
        return None, args[2]
    return None


def _seen(tag, kind, args, log, hook):
    """Records that ``hook`` ran and checks that the state in its arguments is ``tag``'s own."""
    where = _where_state_is(kind, args)
    if where is not None:
        server, clients = where
        assert server is None or set(server) == {tag}, (tag, hook, server)
        assert set(clients) == {tag}, (tag, hook, clients)
    log.add((tag, hook))


def _aggregate(ctx, view):
    new, received = aggregation.aggregate(ctx.structure, {"params": view.global_vars["params"]},
                                          {"params": view.trained_vars["params"]}, view.selection.upload,
                                          view.selection.weights, ("params",))
    return new["params"], received


def _spy_method(log):
    """FedAvg with every hook present, each checking that it sees only the state named 'inner'."""
    hooks = {
        "init": lambda ctx, view: MethodState(server={"inner": jnp.zeros(())},
                                              clients={"inner": jnp.zeros((ctx.num_clients,))}),
        "plan": base.train_everything, "client_start": base.start_from_global,
        "step_plan": lambda ctx, plan, key, step: plan, "objective": base.cross_entropy,
        "transform_grads": lambda ctx, grads, step: grads, "select": base.upload_trained,
        "update": base.keep_state, "metrics": lambda ctx, view: {"inner_metric": jnp.zeros(())},
        "personal": base.global_is_personal, "active_clients": lambda ctx, state: np.ones(ctx.num_clients, bool),
        "summarize": lambda ctx, view: jnp.zeros(view.cohort.valid.shape),
        "server_correct": lambda ctx, view: view.aggregated["params"], "aggregate": _aggregate,
        "encode": lambda ctx, view: view.trained_vars["params"],
        "rewrite_global": lambda ctx, view: view.new_global_vars,
    }

    def spied(hook, fn):
        def run(*args):
            _seen("inner", HOOK_KINDS[hook], args, log, hook)
            return fn(*args)
        return run

    return base.make_method("spy", **{h: spied(h, f) for h, f in hooks.items()})


def _spy_wrapper(tag, log):
    """A wrapper adding to every hook that reads state, checking that it sees only its own part ``tag``."""

    def init(ctx, view):
        return MethodState(server={tag: jnp.zeros(())}, clients={tag: jnp.zeros((ctx.num_clients,))})

    def added(hook):
        def run(*args):
            *own, inner_result = args
            _seen(tag, HOOK_KINDS[hook], own, log, hook)
            if hook == "update":
                return own[1].method_state
            if hook == "metrics":
                return {**inner_result, f"{tag}_metric": jnp.ones(())}
            return inner_result
        return run

    hooks = {h: added(h) for h, kind in HOOK_KINDS.items() if kind not in ("init", "none")}
    return Wrapper(lambda name: f"{name}+{tag}", init=init, hooks=hooks)


@pytest.mark.parametrize("strategy", [stepwise(1), fused()], ids=str)
def test_every_hook_of_a_wrapped_method_sees_its_own_part_of_the_state(mlp, strategy):
    log = set()
    # "quiet" has state and adds to no hook: every inner hook reaches the inner method through the rule alone
    quiet = Wrapper(lambda name: f"{name}+quiet", init=lambda ctx, view: MethodState(
        server={"quiet": jnp.zeros(())}, clients={"quiet": jnp.zeros((ctx.num_clients,))}))
    method = wrap(wrap(wrap(_spy_method(log), quiet), _spy_wrapper("own", log)), _spy_wrapper("outer", log))
    assert method.name == "spy+quiet+own+outer"
    r = FederatedRound(mlp, method, num_clients=N, cohort_size=K, client_optimizer=client_sgd(0.1),
                       strategy=strategy)
    state = r.init(jax.random.key(0))
    assert jax.tree.structure(state.method_state.server) == jax.tree.structure(
        ((({"inner": 0}, {"quiet": 0}), {"own": 0}), {"outer": 0}))
    state, metrics = r(state, make_cohort((4,), k=K, steps=2, client_ids=[0, 2, 4]), jax.random.key(1))
    assert {"inner_metric", "own_metric", "outer_metric"} <= set(metrics)
    r.method.personal(r.ctx, state.method_state, state.variables)
    assert r.method.active_clients(r.ctx, state.method_state).shape == (N,)
    stateful = {h for h, kind in HOOK_KINDS.items() if kind not in ("init", "none")}
    assert {h for t, h in log if t == "inner"} == stateful | {"init", "step_plan"}
    for tag in ("own", "outer"):
        assert {h for t, h in log if t == tag} == stateful, tag


def test_wrappers_refuse_what_they_declare_in_one_sentence():
    with pytest.raises(UserError, match=r"^DP-FedAvg cannot wrap fednova: its server step reads every client's "):
        dp_fedavg(fednova(), clip=1.0, noise_multiplier=1.0)
    with pytest.raises(UserError, match=r"^control variates cannot wrap embracingfl: control variates need every "):
        control_variates(embracingfl())
    with pytest.raises(UserError, match="DP-FedAvg cannot wrap dp-fedavg: it aggregates its own way"):
        dp_fedavg(dp_fedavg(base.make_method("fedavg"), clip=1.0, noise_multiplier=0.0), clip=1.0,
                  noise_multiplier=0.0)
    with pytest.raises(UserError, match="a wrapper cannot add to bogus"):
        Wrapper(lambda name: name, hooks={"bogus": lambda *a: None})


def test_a_wrapped_method_refuses_the_streamed_strategy_in_one_sentence(mlp):
    """Every wrapper keeps per-client or whole-cohort state, so the streamed strategy is refused when built."""
    streamable = base.make_method("fedavg", capabilities=base.Capabilities(streamable="per_client"))
    with pytest.raises(UserError, match=r"^method fedavg\+es needs the whole cohort at once, so it cannot be "
                                        r"streamed; use the fused, stepwise or debug strategy\.$"):
        FederatedRound(mlp, early_stopping(streamable), num_clients=N, cohort_size=K,
                       client_optimizer=client_sgd(0.1), strategy=streamed(1))


def test_wrapping_changes_only_what_the_wrapper_declares():
    """Early stopping around FedAvg: same hooks where it adds nothing (projected), its capabilities on top."""
    inner = base.make_method("fedavg")
    method = early_stopping(inner)
    assert method.name == "fedavg+es" and method.capabilities.needs_holdout
    assert dataclasses.replace(Wrapper(lambda n: n)).refuses == {}
    for hook in ("step_plan", "groups", "adapt_model", "server_correct", "aggregate", "summarize", "metrics",
                 "rewrite_global"):
        assert getattr(method, hook) is getattr(inner, hook) is None, hook


def _carrying(tag, log):
    """FedAvg whose select, aggregate and server_correct each hand a value on, and whose later hooks record what
    they were handed (``log[hook] = sorted carried items``)."""

    def seen(hook, view):
        log[(tag, hook)] = {h: int(v) for h, v in (view.carried or {}).items()}

    def select(ctx, view):
        return Carry(base.upload_trained(ctx, view), 1)

    def aggregate(ctx, view):
        seen("aggregate", view)
        return Carry(_aggregate(ctx, view), 2)

    def server_correct(ctx, view):
        seen("server_correct", view)
        return Carry(view.aggregated["params"], 3)

    def update(ctx, view):
        seen("update", view)
        return view.method_state

    def metrics(ctx, view):
        seen("metrics", view)
        return {}

    return base.make_method(tag, select=select, aggregate=aggregate, server_correct=server_correct, update=update,
                            metrics=metrics)


def test_hooks_hand_their_results_on_and_wrappers_keep_them_apart(mlp):
    """What select, aggregate and server_correct carry reaches the later hooks of the round (RoundView.carried);
    around a wrapper that carries its own values, each part sees only its own."""
    log = {}

    def own(hook, value):
        def run(*args):
            *args, inner_result = args
            if hook in ("update", "metrics"):
                log[("own", hook)] = dict(args[1].carried)
                return args[1].method_state if hook == "update" else inner_result
            return Carry(inner_result, value)
        return run

    wrapper = Wrapper(lambda name: f"{name}+own", hooks={"select": own("select", 10), "aggregate": own("aggregate", 20),
                                                         "update": own("update", None),
                                                         "metrics": own("metrics", None)})
    r = FederatedRound(mlp, wrap(_carrying("inner", log), wrapper), num_clients=N, cohort_size=K,
                       client_optimizer=client_sgd(0.1), strategy=fused())
    r(r.init(jax.random.key(0)), make_cohort((4,), k=K, steps=2, client_ids=[0, 2, 4]), jax.random.key(1))
    everything = {"select": 1, "aggregate": 2, "server_correct": 3}
    assert log[("inner", "aggregate")] == {"select": 1}
    assert log[("inner", "server_correct")] == {"select": 1, "aggregate": 2}
    assert log[("inner", "update")] == log[("inner", "metrics")] == everything
    assert {h: int(v) for h, v in log[("own", "update")].items()} == {"select": 10, "aggregate": 20}
    with pytest.raises(UserError, match="hands on a result from select"):
        streamable = _carrying("inner", {})._replace(aggregate=None, server_correct=None).with_capabilities(
            streamable="per_client")
        s = FederatedRound(mlp, streamable, num_clients=N, cohort_size=K, client_optimizer=client_sgd(0.1),
                           strategy=streamed(1))
        s(s.init(jax.random.key(0)), make_cohort((4,), k=K, steps=2), jax.random.key(1))

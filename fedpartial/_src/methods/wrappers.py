"""One composition rule for wrappers: a method around a method, with its own state, adding to some hooks.

A :class:`Wrapper` declares only what it adds: its own state (``init``), the hooks it adds to, how it
changes the capabilities, and which hooks of the wrapped ("inner") method it cannot take.  :func:`wrap`
does the rest, the same way for every wrapper (early stopping, FedDH's reweighting, SCAFFOLD's control
variates, DP-FedAvg, and any of a user's own):

* **State** is nested as ``MethodState(server=(inner, own), clients=(inner, own))``; the cohort's rows
  (``RoundView.client_state``, ``LocalStep.client_state``) are ``(inner rows, own rows)`` and the server
  state a local step sees (``LocalStep.server_state``) is ``(inner, own)`` too.
* **Every hook of the inner method** is called with its own part of the state only, whatever the hook:
  :data:`HOOK_KINDS` says where each :class:`~fedpartial._src.core.types.Method` hook reads state, and a
  hook added to ``Method`` without an entry there is an error at import, so no hook is ever passed
  through unprojected.
* **A hook the wrapper adds to** is called with the hook's usual arguments, the state in them being the
  wrapper's own part, and one more, last: what the inner method's hook returned on its part (None where
  the inner method has no such hook).  Its result is the composed hook's, except for ``update``, which
  returns the wrapper's own new state (the rule nests it beside the inner method's).
* **Refusals** are declared (``refuses``: an inner hook and why the wrapper cannot take a method that
  has it), so a combination that makes no sense is one sentence when it is built, never a crash later.

Example — count each client's rounds, around any method::

    def counting() -> Wrapper:
        def init(ctx, view):
            return MethodState(clients=jnp.zeros((ctx.num_clients,), jnp.int32))

        def update(ctx, view, inner_state):  # view holds this wrapper's own state
            rows = view.client_state + 1
            return view.method_state._replace(clients=scatter_clients(
                view.method_state.clients, cohort_rows(view), rows, view.cohort.valid))

        return Wrapper(lambda name: f"{name}+count", init=init, hooks={"update": update})

    method = wrap(fedldf(n=4), counting())   # 'fedldf+count'

The guide's section "Writing a wrapper" (docs/methods.md) says the same for users.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import CARRYING_HOOKS, Capabilities, Carry, InitView, Method, MethodContext, MethodState

#: how each hook of a :class:`Method` carries the method's state, so that :func:`wrap` can hand the inner
#: method its part: ``view`` (a ``RoundView`` second), ``step`` (a ``LocalStep`` third), ``state`` (a
#: ``MethodState`` second), ``rows`` (the client's rows third: ``client_start``), ``init``, ``update``, or
#: ``none`` (the hook reads no state).
HOOK_KINDS: Mapping[str, str] = types.MappingProxyType({
    "init": "init", "plan": "view", "client_start": "rows", "step_plan": "none", "objective": "step",
    "select": "view", "update": "update", "metrics": "view", "groups": "none", "personal": "state",
    "active_clients": "state", "server_correct": "view", "adapt_model": "none", "summarize": "view",
    "transform_grads": "step", "aggregate": "view", "encode": "view", "rewrite_global": "view",
})
#: the fields of a :class:`Method` that are not hooks
NOT_HOOKS = ("name", "capabilities")

if set(HOOK_KINDS) | set(NOT_HOOKS) != set(Method._fields):  # a new hook must say where it reads state
    raise AssertionError(f"wrappers.HOOK_KINDS does not cover Method's hooks "
                         f"{sorted(set(Method._fields) - set(HOOK_KINDS) - set(NOT_HOOKS))}")


def _own_state(ctx: MethodContext, view: InitView) -> MethodState:
    del ctx, view
    return MethodState()


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """What a wrapper adds to the method it wraps (see the module docstring for the calling convention).

    Attributes:
      name: the composed method's name from the inner one's (``lambda name: f"{name}+es"``).
      init: ``(ctx, InitView) -> MethodState``, the wrapper's own state (default: none).
      hooks: hook name -> the wrapper's hook (the usual arguments with its own state, then the inner result).
      capabilities: the composed method's capabilities from the inner one's.
      refuses: inner hook -> why the wrapper cannot take a method that has it (one clause).
      label: the wrapper's name in messages (default: the composed name's suffix).
    """

    name: Callable[[str], str]
    init: Callable[[MethodContext, InitView], MethodState] = _own_state
    hooks: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    capabilities: Callable[[Capabilities], Capabilities] = lambda caps: caps
    refuses: Mapping[str, str] = dataclasses.field(default_factory=dict)
    label: str | None = None

    def __post_init__(self):
        unknown = sorted(set(self.hooks) - (set(HOOK_KINDS) - {"init"}))
        if unknown:
            raise UserError(f"a wrapper cannot add to {', '.join(unknown)}: the hooks are "
                            f"{', '.join(h for h in HOOK_KINDS if h != 'init')} (its own state is 'init').")


def _part(tree: Any, i: int) -> Any:
    """Part ``i`` of a nested ``(inner, own)`` value; ``()`` (no rows: per-client state kept off the device) stays."""
    return () if isinstance(tree, tuple) and len(tree) == 0 else tree[i]


def _state_part(state: MethodState, i: int) -> MethodState:
    return MethodState(server=_part(state.server, i), clients=_part(state.clients, i))


def _nest(inner: MethodState, own: MethodState) -> MethodState:
    return MethodState(server=(inner.server, own.server), clients=(inner.clients, own.clients))


def _carried_part(carried: dict | None, i: int) -> dict | None:
    """Part ``i`` of what earlier hooks carried (each value ``(inner, own)``, None where a part carried nothing)."""
    if carried is None:
        return None
    return {hook: value[i] for hook, value in carried.items() if value[i] is not None}


def _project(kind: str, args: tuple, i: int) -> tuple:
    """A hook's arguments ``(ctx, ...)`` with the state (and what earlier hooks carried) cut to part ``i``."""
    if kind in ("view", "update"):
        ctx, view, *rest = args
        view = view._replace(method_state=_state_part(view.method_state, i), client_state=_part(view.client_state, i),
                             carried=_carried_part(view.carried, i))
        return (ctx, view, *rest)
    if kind == "step":
        ctx, x, step = args
        return ctx, x, step._replace(client_state=_part(step.client_state, i),
                                     server_state=_part(step.server_state, i))
    if kind == "state":
        ctx, state, *rest = args
        return (ctx, _state_part(state, i), *rest)
    if kind == "rows":
        ctx, global_vars, rows, plan = args
        return ctx, global_vars, _part(rows, i), plan
    return args


def _compose(hook: str, inner: Method, wrapper: Wrapper) -> Callable | None:
    kind, inner_hook, own_hook = HOOK_KINDS[hook], getattr(inner, hook), wrapper.hooks.get(hook)
    if kind == "init":
        return lambda ctx, view: _nest(inner.init(ctx, view), wrapper.init(ctx, view))
    if kind == "update":
        def update(*args):
            inner_state = inner.update(*_project(kind, args, 0))
            own_args = _project(kind, args, 1)
            own = own_hook(*own_args, inner_state) if own_hook is not None else own_args[1].method_state
            return _nest(inner_state, own)
        return update
    if own_hook is None:
        if inner_hook is None or kind == "none":
            return inner_hook
        if hook in CARRYING_HOOKS:
            return lambda *args: _nest_carry(inner_hook(*_project(kind, args, 0)), own_carries=False)
        return lambda *args: inner_hook(*_project(kind, args, 0))

    def added(*args):
        inner_result = None if inner_hook is None else inner_hook(*_project(kind, args, 0))
        if hook not in CARRYING_HOOKS:
            return own_hook(*_project(kind, args, 1), inner_result)
        inner_value = inner_result.value if isinstance(inner_result, Carry) else None
        inner_result = inner_result.result if isinstance(inner_result, Carry) else inner_result
        return _nest_carry(own_hook(*_project(kind, args, 1), inner_result), inner_value)
    return added


def _nest_carry(out: Any, inner_value: Any = None, own_carries: bool = True) -> Any:
    """The composed result of a carrying hook, what each part carried nested as ``(inner, own)`` (None where a
    part carried nothing).  ``out`` is the wrapper's result, or with ``own_carries`` False the inner method's."""
    value = out.value if isinstance(out, Carry) else None
    result = out.result if isinstance(out, Carry) else out
    if not own_carries:
        inner_value, value = value, None
    if inner_value is None and value is None:
        return result
    return Carry(result, (inner_value, value))


def wrap(method: Method, wrapper: Wrapper) -> Method:
    """``method`` with ``wrapper`` around it: every hook composed by the one rule (module docstring).

    Raises a one-sentence :class:`UserError` when ``method`` has a hook the wrapper refuses.

    Args:
      method: any method.
      wrapper: the :class:`~fedpartial.Wrapper`.

    Returns:
      The wrapped :class:`~fedpartial.Method`.

    Raises:
      UserError: ``method`` has a hook the wrapper refuses.
    """
    label = wrapper.label or wrapper.name("").lstrip("+-") or "this wrapper"
    for hook, why in wrapper.refuses.items():
        if getattr(method, hook) is not None:
            raise UserError(f"{label} cannot wrap {method.name}: {why}.")
    hooks = {hook: _compose(hook, method, wrapper) for hook in HOOK_KINDS}
    return method._replace(name=wrapper.name(method.name), capabilities=wrapper.capabilities(method.capabilities),
                           **hooks)

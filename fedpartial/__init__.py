"""fedpartial: federated learning with partial model training, one jitted function per round.

The cohort is one stacked parameter pytree with a leading client axis; per-client
structured masks say what each client trains, keeps and uploads.

The public API is this namespace and four curated subpackages:

* ``fedpartial`` — running (:class:`RunConfig`, :class:`Simulation`, :class:`AsyncSimulation`, :func:`run`), the round
  (:class:`FederatedRound` and its strategies) and everything a method author needs
  (:class:`Method`, :func:`make_method`, the views and plans, the default pieces) and the combinators
  around any method (:func:`early_stopping`, :func:`reweight`, :func:`dp_fedavg` with its
  :class:`PrivacyAccountant`), all built by one rule (:class:`Wrapper`, :func:`wrap`);
* :mod:`fedpartial.methods` — the built-in methods and their catalog (``METHODS``);
* :mod:`fedpartial.models` — the model zoo and adapters for any Flax module;
* :mod:`fedpartial.data` — data sources, partitions and cohort packing;
* :mod:`fedpartial.masks` — building, combining and counting structured masks (:class:`Mask`).

Everything under ``fedpartial._src`` is private and may change without notice.
"""

import importlib
from typing import TYPE_CHECKING

from fedpartial._src.version import __version__

if TYPE_CHECKING:  # the names as static tools (type checkers, the API reference) read them
    from fedpartial._src.core.errors import DivergedError, NothingTrainedWarning, UserError
    from fedpartial._src.core.masks import Mask
    from fedpartial._src.core.structure import ModelStructure
    from fedpartial._src.engine.metrics import traffic_totals
    from fedpartial._src.experiment.evaluation import evaluate
    from fedpartial._src.core.views import VIEW_FIELDS, InitView, LocalStep, LossAux, RoundView
    from fedpartial._src.core.types import (
        Batch,
        Capabilities,
        Carry,
        ClientGroup,
        ClientOptimizer,
        ClientPlan,
        CohortInfo,
        Holdout,
        LocalGraph,
        Method,
        MethodContext,
        MethodState,
        OptimizerSettings,
        PersonalModels,
        Selection,
        ServerData,
        client_sgd,
    )
    from fedpartial._src.engine.round import FederatedRound
    from fedpartial._src.engine.strategy import Strategy, debug, fused, parse_strategy, stepwise, streamed
    from fedpartial._src.engine.types import Cohort, ServerState
    from fedpartial._src.experiment.config import RunConfig
    from fedpartial._src.experiment.asynchronous import AsyncSimulation
    from fedpartial._src.experiment.runs import run
    from fedpartial._src.experiment.simulation import Simulation
    from fedpartial._src.core.population import broadcast_clients, cohort_rows, gather_clients, scatter_clients
    from fedpartial._src.methods.base import cross_entropy, make_method, upload_trained, with_penalty
    from fedpartial._src.methods.early_stopping import early_stopping
    from fedpartial._src.methods.privacy.accountant import PrivacyAccountant
    from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
    from fedpartial._src.methods.catalog import ENTRY_POINT_GROUP
    from fedpartial._src.methods.registry import MethodSpec, Option
    from fedpartial._src.methods.weighting.compose import reweight
    from fedpartial._src.methods.wrappers import Wrapper, wrap

    from fedpartial import data, masks, methods, models

#: each public name -> the private module that defines it.  A name is imported on first use (PEP 562), so
#: ``import fedpartial`` takes milliseconds and the command line can answer Ctrl-C while JAX loads;
#: ``tests/test_public_api.py`` checks that this table and the imports above agree.
_WHERE = {
    "DivergedError": "fedpartial._src.core.errors",
    "UserError": "fedpartial._src.core.errors",
    "NothingTrainedWarning": "fedpartial._src.core.errors",
    "Mask": "fedpartial._src.core.masks",
    "ModelStructure": "fedpartial._src.core.structure",
    "traffic_totals": "fedpartial._src.engine.metrics",
    "evaluate": "fedpartial._src.experiment.evaluation",
    "VIEW_FIELDS": "fedpartial._src.core.views",
    "Batch": "fedpartial._src.core.types",
    "Capabilities": "fedpartial._src.core.types",
    "Carry": "fedpartial._src.core.types",
    "ClientGroup": "fedpartial._src.core.types",
    "ClientOptimizer": "fedpartial._src.core.types",
    "ClientPlan": "fedpartial._src.core.types",
    "CohortInfo": "fedpartial._src.core.types",
    "Holdout": "fedpartial._src.core.types",
    "InitView": "fedpartial._src.core.views",
    "LocalGraph": "fedpartial._src.core.types",
    "LocalStep": "fedpartial._src.core.views",
    "LossAux": "fedpartial._src.core.views",
    "Method": "fedpartial._src.core.types",
    "MethodContext": "fedpartial._src.core.types",
    "MethodState": "fedpartial._src.core.types",
    "OptimizerSettings": "fedpartial._src.core.types",
    "PersonalModels": "fedpartial._src.core.types",
    "RoundView": "fedpartial._src.core.views",
    "Selection": "fedpartial._src.core.types",
    "ServerData": "fedpartial._src.core.types",
    "client_sgd": "fedpartial._src.core.types",
    "FederatedRound": "fedpartial._src.engine.round",
    "Strategy": "fedpartial._src.engine.strategy",
    "debug": "fedpartial._src.engine.strategy",
    "fused": "fedpartial._src.engine.strategy",
    "parse_strategy": "fedpartial._src.engine.strategy",
    "stepwise": "fedpartial._src.engine.strategy",
    "streamed": "fedpartial._src.engine.strategy",
    "Cohort": "fedpartial._src.engine.types",
    "ServerState": "fedpartial._src.engine.types",
    "RunConfig": "fedpartial._src.experiment.config",
    "Simulation": "fedpartial._src.experiment.simulation",
    "run": "fedpartial._src.experiment.runs",
    "AsyncSimulation": "fedpartial._src.experiment.asynchronous",
    "broadcast_clients": "fedpartial._src.core.population",
    "cohort_rows": "fedpartial._src.core.population",
    "gather_clients": "fedpartial._src.core.population",
    "scatter_clients": "fedpartial._src.core.population",
    "cross_entropy": "fedpartial._src.methods.base",
    "make_method": "fedpartial._src.methods.base",
    "upload_trained": "fedpartial._src.methods.base",
    "with_penalty": "fedpartial._src.methods.base",
    "early_stopping": "fedpartial._src.methods.early_stopping",
    "PrivacyAccountant": "fedpartial._src.methods.privacy.accountant",
    "dp_fedavg": "fedpartial._src.methods.privacy.dp_fedavg",
    "ENTRY_POINT_GROUP": "fedpartial._src.methods.catalog",
    "MethodSpec": "fedpartial._src.methods.registry",
    "Option": "fedpartial._src.methods.registry",
    "reweight": "fedpartial._src.methods.weighting.compose",
    "Wrapper": "fedpartial._src.methods.wrappers",
    "wrap": "fedpartial._src.methods.wrappers",
}

#: the curated subpackages, imported on first use too
_SUBPACKAGES = ("data", "masks", "methods", "models")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        value = importlib.import_module(f"fedpartial.{name}")
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module 'fedpartial' has no attribute {name!r}")
    globals()[name] = value  # later uses find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

__all__ = [
    # running
    "RunConfig", "Simulation", "AsyncSimulation", "run",
    # checking a run by hand: a model's layers, a round's traffic, evaluating given models on given data
    "ModelStructure", "evaluate", "traffic_totals",
    # the round
    "Cohort", "FederatedRound", "ServerState", "Strategy", "debug", "fused", "parse_strategy", "stepwise",
    "streamed",
    # writing a method
    "Batch", "Capabilities", "Carry", "ClientGroup", "ClientOptimizer", "ClientPlan", "CohortInfo", "ENTRY_POINT_GROUP",
    "Holdout", "InitView", "LocalGraph", "LocalStep", "LossAux", "Mask", "Method", "MethodContext", "MethodSpec",
    "MethodState", "Option", "OptimizerSettings", "PersonalModels", "RoundView", "Selection", "ServerData",
    "VIEW_FIELDS",
    "broadcast_clients", "client_sgd", "cohort_rows", "cross_entropy", "early_stopping", "gather_clients",
    "make_method", "reweight", "scatter_clients", "upload_trained", "with_penalty",
    # a method around any method: one composition rule (early_stopping, reweight and dp_fedavg use it)
    "Wrapper", "wrap",
    # differential privacy: DP-FedAvg around any method, and its accountant
    "PrivacyAccountant", "dp_fedavg",
    # errors
    "DivergedError", "NothingTrainedWarning", "UserError",
    "__version__",
    # curated subpackages
    "data", "masks", "methods", "models",
]

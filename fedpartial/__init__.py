"""fedpartial: federated learning with partial model training, one jitted function per round.

The cohort is one stacked parameter pytree with a leading client axis; per-client
structured masks say what each client trains, keeps and uploads.

The public API is this namespace and three curated subpackages:

* ``fedpartial`` — running (:class:`RunConfig`, :class:`Simulation`, :func:`run`), the round
  (:class:`FederatedRound` and its strategies) and everything a method author needs
  (:class:`Method`, :func:`make_method`, the views and plans, the default pieces) and the combinators
  around any method (:func:`early_stopping`, :func:`reweight`, :func:`dp_fedavg` with its
  :class:`PrivacyAccountant`);
* :mod:`fedpartial.methods` — the built-in methods and their catalog (``METHODS``);
* :mod:`fedpartial.models` — the model zoo and adapters for any Flax module;
* :mod:`fedpartial.data` — data sources, partitions and cohort packing;
* :mod:`fedpartial.masks` — building, combining and counting structured masks (:class:`Mask`).

Everything under ``fedpartial._src`` is private and may change without notice.
"""

from fedpartial._src.core.errors import DivergedError, UserError
from fedpartial._src.core.masks import Mask
from fedpartial._src.core.types import (
    VIEW_FIELDS,
    Batch,
    Capabilities,
    ClientGroup,
    ClientOptimizer,
    ClientPlan,
    CohortInfo,
    Holdout,
    InitView,
    LocalGraph,
    LocalStep,
    LossAux,
    Method,
    MethodContext,
    MethodState,
    OptimizerSettings,
    PersonalModels,
    RoundView,
    Selection,
    ServerData,
    client_sgd,
)
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import Strategy, debug, fused, parse_strategy, stepwise, streamed
from fedpartial._src.engine.types import Cohort, ServerState
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation, run
from fedpartial._src.core.population import broadcast_clients, cohort_rows, gather_clients, scatter_clients
from fedpartial._src.methods.base import cross_entropy, make_method, upload_trained, with_penalty
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.methods.privacy.accountant import PrivacyAccountant
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from fedpartial._src.methods.catalog import ENTRY_POINT_GROUP
from fedpartial._src.methods.registry import MethodSpec, Option
from fedpartial._src.methods.weighting.feddh import reweight
from fedpartial._src.version import __version__

from fedpartial import data, masks, methods, models  # noqa: E402  (the curated subpackages, after the names they use)

__all__ = [
    # running
    "RunConfig", "Simulation", "run",
    # the round
    "Cohort", "FederatedRound", "ServerState", "Strategy", "debug", "fused", "parse_strategy", "stepwise",
    "streamed",
    # writing a method
    "Batch", "Capabilities", "ClientGroup", "ClientOptimizer", "ClientPlan", "CohortInfo", "ENTRY_POINT_GROUP",
    "Holdout", "InitView", "LocalGraph", "LocalStep", "LossAux", "Mask", "Method", "MethodContext", "MethodSpec",
    "MethodState", "Option", "OptimizerSettings", "PersonalModels", "RoundView", "Selection", "ServerData",
    "VIEW_FIELDS",
    "broadcast_clients", "client_sgd", "cohort_rows", "cross_entropy", "early_stopping", "gather_clients",
    "make_method", "reweight", "scatter_clients", "upload_trained", "with_penalty",
    # differential privacy: DP-FedAvg around any method, and its accountant
    "PrivacyAccountant", "dp_fedavg",
    # errors
    "DivergedError", "UserError",
    "__version__",
    # curated subpackages
    "data", "masks", "methods", "models",
]

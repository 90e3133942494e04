"""fedpartial: federated learning with partial model training, one jitted function per round.

The cohort is one stacked parameter pytree with a leading client axis; per-client
structured masks say what each client trains, keeps and uploads.

The public API is this namespace and three curated subpackages:

* ``fedpartial`` — running (:class:`RunConfig`, :class:`Simulation`, :func:`run`), the round
  (:class:`FederatedRound` and its strategies) and everything a method author needs
  (:class:`Method`, :func:`make_method`, the views and plans, the default pieces);
* :mod:`fedpartial.methods` — the built-in methods and their catalog (``METHODS``);
* :mod:`fedpartial.models` — the model zoo and adapters for any Flax module;
* :mod:`fedpartial.data` — data sources, partitions and cohort packing.

Everything under ``fedpartial._src`` is private and may change without notice.
"""

from fedpartial._src.core.errors import DivergedError, UserError
from fedpartial._src.core.masks import Mask
from fedpartial._src.core.types import (
    Batch,
    ClientGroup,
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
    PersonalModels,
    RoundView,
    Selection,
    ServerData,
)
from fedpartial._src.engine.round import (
    Cohort,
    FederatedRound,
    ServerState,
    Strategy,
    debug,
    fused,
    parse_strategy,
    stepwise,
    streamed,
)
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation, run
from fedpartial._src.core.population import cohort_rows, gather_clients, scatter_clients
from fedpartial._src.methods.base import cross_entropy, make_method, upload_trained, with_penalty
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.methods.registry import MethodSpec, Option
from fedpartial._src.methods.weighting.feddh import reweight
from fedpartial._src.version import __version__

__all__ = [
    # running
    "RunConfig", "Simulation", "run",
    # the round
    "Cohort", "FederatedRound", "ServerState", "Strategy", "debug", "fused", "parse_strategy", "stepwise",
    "streamed",
    # writing a method
    "Batch", "ClientGroup", "ClientPlan", "CohortInfo", "Holdout", "InitView", "LocalGraph", "LocalStep",
    "LossAux", "Mask", "Method", "MethodContext", "MethodSpec", "MethodState", "Option", "PersonalModels",
    "RoundView", "Selection", "ServerData",
    "cohort_rows", "cross_entropy", "early_stopping", "gather_clients", "make_method", "reweight",
    "scatter_clients", "upload_trained", "with_penalty",
    # errors
    "DivergedError", "UserError",
    "__version__",
]

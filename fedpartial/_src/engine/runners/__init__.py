"""One runner per execution strategy (:mod:`fedpartial._src.engine.strategy`), all behind the interface of
:class:`~fedpartial._src.engine.runners.base.Runner`: built once with the round, ``runner(state, cohort,
key) -> (state, metrics)``."""

from fedpartial._src.engine.runners.debug import Debug
from fedpartial._src.engine.runners.fused import Fused
from fedpartial._src.engine.runners.stepwise import Stepwise
from fedpartial._src.engine.runners.streamed import Streamed

#: the runner of each :attr:`Strategy.kind <fedpartial._src.engine.strategy.Strategy.kind>`
RUNNERS = {"fused": Fused, "stepwise": Stepwise, "stream": Streamed, "debug": Debug}

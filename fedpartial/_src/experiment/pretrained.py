"""``--init-from``: a run's initial global model read from a run folder or a saved parameter file, and the
``final_params.npz`` every run folder gets at its end (what a later run starts from).

Pre-training centrally is a run with one client (``--clients 1 --cohort 1``) on the public part of the data;
federated fine-tuning is a second run with ``--init-from`` that run's folder (docs/transformers.md).
"""

from __future__ import annotations

import os

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import disk
from fedpartial._src.models.params_io import load_params, save_params, starting_from

__all__ = ["FINAL_PARAMS", "initial_model", "params_file", "write_final_params"]

#: the file in a run folder holding its final global model
FINAL_PARAMS = "final_params.npz"


def params_file(path: str) -> str:
    """The parameter file ``--init-from PATH`` names: ``PATH`` itself, or a run folder's :data:`FINAL_PARAMS`."""
    if os.path.isdir(path):
        inside = os.path.join(path, FINAL_PARAMS)
        if not os.path.isfile(inside):
            raise UserError(f"--init-from {path} is a folder without {FINAL_PARAMS}; give a fedpartial run folder "
                            f"(a run writes {FINAL_PARAMS} when it ends) or a .npz parameter file.")
        return inside
    if not os.path.exists(path):
        raise UserError(f"--init-from {path} does not exist; give a fedpartial run folder or a .npz parameter file.")
    return path


def initial_model(model, init_from: str | None):
    """``model`` starting from the parameters ``init_from`` names (checked against it), or ``model`` when None."""
    if init_from is None:
        return model
    path = params_file(init_from)
    return starting_from(model, load_params(path), source=f"the parameters in {path} (--init-from)")


def write_final_params(run_dir: str | None, variables: dict) -> None:
    """Writes the global model's ``variables`` to the run folder's :data:`FINAL_PARAMS` (nothing without one)."""
    if not run_dir:
        return
    try:
        save_params(variables, os.path.join(run_dir, FINAL_PARAMS))
    except OSError as failure:  # a full disk is the run's out-of-space ending, said in one sentence
        reason = disk.out_of_space(failure)
        if reason is None:
            raise
        raise disk.OutOfSpace(f"cannot write the final parameters of {run_dir}: {reason}.") from None

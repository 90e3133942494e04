"""The public API: what ``import fedpartial`` and its curated subpackages offer, each name by one path."""

import importlib

import fedpartial

PUBLIC = ("fedpartial", "fedpartial.methods", "fedpartial.models", "fedpartial.data", "fedpartial.masks")

TOP = [
    "Batch", "Capabilities", "Carry", "ClientGroup", "ClientOptimizer", "ClientPlan", "Cohort", "CohortInfo",
    "DivergedError", "NothingTrainedWarning",
    "ENTRY_POINT_GROUP", "FederatedRound", "Holdout", "InitView", "LocalGraph", "LocalStep", "LossAux", "Mask",
    "Method", "MethodContext", "MethodSpec", "MethodState", "Option", "OptimizerSettings", "PersonalModels",
    "PrivacyAccountant", "RoundView", "RunConfig", "Selection", "ServerData", "ServerState", "Simulation", "Strategy",
    "AsyncSimulation", "UserError",
    "VIEW_FIELDS", "Wrapper", "wrap", "ModelStructure", "evaluate", "traffic_totals", "__version__", "broadcast_clients", "client_sgd", "cohort_rows", "cross_entropy", "data",
    "debug", "dp_fedavg", "early_stopping", "fused", "gather_clients", "make_method", "masks", "methods", "models",
    "parse_strategy", "reweight", "run", "scatter_clients", "stepwise", "streamed", "upload_trained",
    "with_penalty",
]


def test_the_top_level_names_are_pinned():
    assert sorted(fedpartial.__all__) == sorted(TOP)


def test_every_public_name_exists_and_has_one_import_path():
    """A name is offered by exactly one public namespace (the subpackages themselves excepted)."""
    owners: dict[str, list[str]] = {}
    for name in PUBLIC:
        module = importlib.import_module(name)
        for attr in module.__all__:
            assert hasattr(module, attr), f"{name}.{attr}"
            if attr not in ("data", "masks", "methods", "models"):
                owners.setdefault(attr, []).append(name)
    assert {a: o for a, o in owners.items() if len(o) > 1} == {}


def test_the_public_objects_live_under_the_private_implementation():
    """Nothing public is defined in a facade: each is the implementation's own object."""
    for name in PUBLIC:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            where = getattr(obj, "__module__", None)
            if where is not None and callable(obj):
                assert where.startswith("fedpartial._src."), f"{name}.{attr} is defined in {where}"


def test_every_built_in_method_is_a_public_factory():
    from fedpartial import methods

    for name, spec in methods.METHODS.items():
        assert spec.build().capabilities is not None
        # each registered method's factory is reachable by its public name (variants share a factory)
        assert any(getattr(methods, f, None) is spec.factory for f in methods.__all__), name


def test_the_lazy_table_and_the_static_imports_name_the_same_objects():
    """``import fedpartial`` imports each name on first use from ``_WHERE``; the ``TYPE_CHECKING`` imports
    (what the API reference and type checkers read) must say the same, and ``__all__`` must be exactly both."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(fedpartial))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    static = {a.asname or a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom)
              for a in n.names if n.module.startswith("fedpartial._src")}
    assert static == fedpartial._WHERE
    assert set(fedpartial.__all__) == {*fedpartial._WHERE, *fedpartial._SUBPACKAGES, "__version__"}
    assert set(fedpartial.__all__) <= set(dir(fedpartial))


def test_import_fedpartial_loads_no_jax_until_a_name_is_used():
    import subprocess
    import sys

    # RunConfig is settings alone: reading it loads no JAX either (tests/experiment/test_checked_once.py)
    code = ("import sys, fedpartial; assert 'jax' not in sys.modules; fedpartial.RunConfig; "
            "assert 'jax' not in sys.modules; fedpartial.Simulation; assert 'jax' in sys.modules; "
            "print(fedpartial.methods.fedavg.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "fedavg", done.stderr

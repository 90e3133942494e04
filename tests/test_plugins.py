"""Method options judged in one place (``Option``), the machine probes apart from the field checks (preflight),
and plug-in methods as first-class as built-in ones: flags, ``compare --option``, the console script's imports
and the names of their run folders.  Parsing and validation only: nothing here trains."""

import math
import sys

import pytest

import fedpartial as fp
from fedpartial._src.analysis import compare
from fedpartial._src.cli import entry
from fedpartial._src.cli.main import build_parser, config_from_args, main
from fedpartial._src.core import memory
from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.preflight import preflight
from fedpartial._src.methods.catalog import METHODS, get_method
from fedpartial._src.methods.registry import Option, between, one_of, positive_int, probability

PLUGIN = '''
import fedpartial as fp


def factory(k: int = 2):
    """FedAvg under a name of its own."""
    return fp.make_method("my_avg")


def clashing(tiers: str = "fast"):
    return fp.make_method("clashing")


def shadowing(seed: int = 0):
    return fp.make_method("shadowing")


SPEC = fp.MethodSpec("spec_avg", lambda k=3, scale=1.0: fp.make_method("spec_avg"), "FedAvg as a spec.")
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_plugin", None)
    yield "my_plugin"
    sys.modules.pop("my_plugin", None)


def test_declarative_checks_say_what_is_allowed():
    assert between(0, 1, low_open=True, high_open=True)(1.0) == "must be a number in (0, 1)"
    assert probability(0.5) is None and probability(1.5) == "must be a number in [0, 1]"
    assert positive_int(0) == "must be a positive integer" and positive_int(2.0) == "must be a positive integer"
    assert one_of("a", "b")("c") == "must be one of a, b"
    opt = Option("mode", str, "a", "a mode", choices=("a", "b"), flag="--my-mode")
    assert opt.problem("b") is None and opt.problem("c") == "must be one of a, b"
    assert Option("x", float, None, "x", between(0, 1)).problem(None) is None  # unset stays allowed
    assert Option("x", float, 0.5, "x", between(0, 1)).problem(math.nan) == "must be a finite number"
    assert opt.refusal("c", "mine") == "mine: --my-mode = 'c' must be one of a, b."
    assert opt.refusal("c", "mine", typed=True) == "--my-mode 'c' is not allowed for mine: it must be one of a, b."


def test_every_built_in_default_passes_its_own_checks():
    for name, spec in METHODS.items():
        for opt in spec.options:
            assert opt.problem(opt.default) is None, (name, opt.name)


@pytest.mark.parametrize("call, message", [
    (lambda: fp.methods.fedad(resample="sometimes"), "fedad: --ad-resample = 'sometimes' must be one of round, step."),
    (lambda: fp.methods.fedad(target="backwards"),
     "fedad: --ad-target = 'backwards' must be one of time-matched, literal."),
    (lambda: fp.methods.fedad(max_rate=1.0), "fedad: --ad-max-rate = 1.0 must be a number in (0, 1)."),
    (lambda: fp.methods.moon(temperature=0.0), "moon: --moon-tau = 0.0 must be a number > 0."),
    (lambda: fp.methods.afd(variant="many"), "afd: --afd-variant = 'many' must be one of single, multi."),
    (lambda: get_method("fedprox", mu=math.inf), "fedprox: --mu = inf must be a finite number."),
])
def test_a_factory_called_directly_is_checked_by_its_options(call, message):
    with pytest.raises(UserError) as e:
        call()
    assert type(e.value) is UserError and str(e.value) == message


def test_the_command_line_says_it_with_the_flag_as_typed(capsys):
    assert main(["run", "--method", "fedad", "--ad-resample", "sometimes", "--out", "/nonexistent/never"]) == 2
    assert capsys.readouterr().err == ("fedpartial: error: --ad-resample 'sometimes' is not allowed for fedad: it must "
                                       "be one of round, step.\n")


def test_validate_judges_the_settings_and_preflight_the_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "host_available", lambda: 2**20)  # a 1 MiB machine
    config = RunConfig(num_clients=100_000, cohort_size=10, out_dir=str(tmp_path / "file"))
    (tmp_path / "file").write_text("")
    config.validate()  # nothing about this machine
    with pytest.raises(ConfigError, match=r"^--clients 100000 needs at least .* more than this machine has"):
        preflight(config)
    monkeypatch.setattr(memory, "host_available", lambda: None)
    with pytest.raises(ConfigError, match=r"^--out '.*file' is a file; it must be a directory"):
        preflight(config)


def test_a_plugin_option_on_a_built_in_flag_of_another_type_is_refused_naming_both(plugin, capsys):
    for method, option, words in (("clashing", "tiers", "which the built-in fedspu, feddrop"),
                                  ("shadowing", "seed", "fedpartial run's own")):
        assert main(["run", "--method", f"{plugin}:{method}", "--out", "/nonexistent/never"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedpartial: error: option '{option}' of method '{plugin}:{method}'")
        assert words in err and len(err.splitlines()) == 1
    assert main(["compare", "--methods", f"fedavg,{plugin}:clashing", "--out", "/nonexistent/never"]) == 2
    assert "--tiers" in capsys.readouterr().err
    # the built-in --tiers keeps its own type: fedspu still parses it as keep ratios
    args = build_parser(["run", "--method", "fedspu"]).parse_args(["run", "--method", "fedspu", "--tiers", "0.5,1"])
    assert config_from_args(args).options == {"tiers": (0.5, 1.0)}


def test_a_plugin_method_spec_gets_its_factory_arguments_as_flags(plugin):
    argv = ["run", "--method", f"{plugin}:SPEC", "--scale", "2.5", "--k", "4"]
    config = config_from_args(build_parser(argv).parse_args(argv))
    assert config.options == {"scale": 2.5, "k": 4}
    assert config.method_name == "spec_avg"


def test_compare_option_addresses_a_module_factory_method(plugin):
    methods = ["fedldf", f"{plugin}:factory", f"{plugin}:SPEC"]
    options = compare.parse_options(["fedldf:n=2", f"{plugin}:factory:k=3", f"{plugin}:SPEC:scale=0.5"], methods)
    assert options == {"fedldf": {"n": 2}, f"{plugin}:factory": {"k": 3}, f"{plugin}:SPEC": {"scale": 0.5}}
    with pytest.raises(UserError, match="is for method 'other:factory', which is not in --methods"):
        compare.parse_options(["other:factory:k=3"], methods)


def test_run_folders_are_named_by_the_method_not_its_import_string(plugin, tmp_path):
    assert RunConfig(method=f"{plugin}:factory").method_name == "my_avg"  # the Method's own name
    assert RunConfig(method=f"{plugin}:SPEC").method_name == "spec_avg"
    base = RunConfig(out_dir=str(tmp_path / "runs"))
    configs = compare.plan(base, [f"{plugin}:factory", "fedavg"], [0], {}, str(tmp_path / "runs"))
    assert [c.run_name for c in configs] == ["my_avg-seed0", "fedavg-seed0"]


def test_the_console_script_imports_from_the_working_directory(plugin, tmp_path, monkeypatch):
    assert entry.importable_working_directory(["/lib"], "/here") == ["/lib", "/here"]  # last: never shadows
    assert entry.importable_working_directory(["", "/lib"], "/here") == ["", "/lib"]  # python -m: already there
    here = tmp_path / "project"
    here.mkdir()
    (here / "local_methods.py").write_text("def mine():\n    pass\n")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(here))])
    monkeypatch.setattr(entry, "main", lambda: __import__("local_methods") and 0)
    with pytest.raises(SystemExit) as e:
        entry.console()
    assert e.value.code == 0
    sys.modules.pop("local_methods", None)

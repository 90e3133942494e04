"""The GPU plan's commands stay valid for the current CLI (they cannot be run here: no GPU)."""

import json
import pathlib
import shlex
import subprocess
import sys

import pytest

from fedpartial._src.bench import suite as bench
from fedpartial._src.cli import main as cli
from fedpartial._src.core.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_plan.sh"


def plan(*args, out=None, python=None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"OUT": str(out)} if out else {}), **({"PYTHON": python} if python else {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


ESSENTIALS = ["check", "convcnn", "convvgg", "seeds", "cohort10k"]


def steps(out, which="all") -> dict[str, list[str]]:
    return {name: argv for name, (_, argv) in limited_steps(out, which).items()}


def limited_steps(out, which="all") -> dict[str, tuple[int, list[str]]]:
    done = plan("--dry-run", which, out=out)
    assert done.returncode == 0, done.stderr
    rows = (line.split("\t") for line in done.stdout.splitlines())
    return {name: (int(limit), shlex.split(command)) for name, limit, command in rows}


def test_list_names_every_step_with_its_limit_and_purpose():
    listed = [line.split(None, 2) for line in plan("list").stdout.splitlines()]
    assert [name for name, _, _ in listed] == [*ESSENTIALS, "vggprec", "cnn1000", "vgg9", "probe", "seeds100", "fedldf",
                                               "models", "placement", "replicas", "lora1000", "tests", "essentials"]
    assert all(what.strip() and limit.endswith("s") for _, limit, what in listed)


def test_the_essentials_fit_one_call_of_a_lent_machine(tmp_path):
    """The essentials: the most telling steps in order, each capped, together at most 9 minutes (a call may
    run 10, and the lent machine gives 15 minutes of device time a task, its start included)."""
    essentials = limited_steps(tmp_path, "essentials")
    assert list(essentials) == ESSENTIALS
    assert all(limit <= 600 for limit, _ in limited_steps(tmp_path).values())
    assert sum(limit for limit, _ in essentials.values()) <= 9 * 60
    listed = dict((line.split(None, 2)[0], line.split(None, 2)[1]) for line in plan("list").stdout.splitlines())
    assert listed["essentials"] == f"{sum(limit for limit, _ in essentials.values())}s"


def test_a_failing_step_does_not_stop_the_next_and_the_plan_says_which_failed(tmp_path):
    done = plan("essentials", out=tmp_path, python="false")  # every step's python fails at once
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("== ") and " took " in line] \
        == ESSENTIALS
    assert done.returncode == 1 and f"failed or were cut off: {' '.join(ESSENTIALS)}" in done.stderr


def test_an_unknown_step_is_one_sentence_and_runs_nothing(tmp_path):
    done = plan("cnn1000", "nope", out=tmp_path / "out")
    assert done.returncode == 2 and "step 'nope' is unknown" in done.stderr and "cnn1000" in done.stderr
    assert not (tmp_path / "out").exists()


def test_every_bench_step_parses_and_writes_into_out(tmp_path):
    commands = steps(tmp_path)
    bench_steps = [name for name, argv in commands.items() if argv[1:4] == ["-m", "fedpartial", "bench"]]
    assert set(bench_steps) == {"cnn1000", "vgg9", "cohort10k", "fedldf", "models"}
    for name in bench_steps:
        args = cli.build_parser().parse_args(commands[name][3:])
        settings = bench.settings_from_args(args)  # every model, method and strategy is known
        assert pathlib.Path(args.out).parent == tmp_path and "gpu" in args.out
        assert settings.rounds == 3
    targets = {name: bench.settings_from_args(cli.build_parser().parse_args(commands[name][3:]))
               for name in ("cnn1000", "vgg9", "cohort10k")}
    assert targets["cnn1000"].models == ("cnn2c1f",) and targets["cnn1000"].cohorts == (1000,)
    assert set(targets["cnn1000"].strategies) == {"fused", "fused:100"}
    assert targets["vgg9"].models == ("vgg9",) and targets["vgg9"].cohorts == (100,)
    assert targets["vgg9"].lr == 0.01  # at the default 0.05 VGG-9 diverges on random data (loss 43 after a round)
    assert targets["cohort10k"].cohorts == (10000,) and set(targets["cohort10k"].strategies) == {"fused",
                                                                                                "stream:1000"}


MODULE_STEPS = ["seeds", "probe", "seeds100", "placement", "replicas", "convcnn", "convvgg"]
#: runs ``python -m MODULE --help`` for each module named on its command line, in one process (each process of its own
#: would import JAX and the package again, seconds each); prints one JSON object: module -> [exit status, its help]
HELPS = """
import contextlib, io, json, runpy, sys
shown = {}
for module in sys.argv[1:]:
    sys.argv, out = [module, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code or 0
    shown[module] = [code, out.getvalue()]
print(json.dumps(shown))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """Each module step's argv and what its module's ``--help`` printed (exit status, text)."""
    commands = steps(tmp_path_factory.mktemp("plan"))
    argvs = {name: commands[name] for name in MODULE_STEPS}
    modules = sorted({argv[argv.index("-m") + 1] for argv in argvs.values()})
    done = subprocess.run([sys.executable, "-c", HELPS, *modules], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (argv, argv[argv.index("-m") + 1], *shown[argv[argv.index("-m") + 1]])
            for name, argv in argvs.items()}


@pytest.mark.parametrize("name", MODULE_STEPS)
def test_every_benchmark_module_step_names_flags_its_module_takes(helps, name):
    argv, module, returncode, shown = helps[name]
    assert returncode == 0, f"{module} --help exited with {returncode}"
    assert "usage:" in shown, f"{module} printed no help"
    for flag in (a for a in argv if a.startswith("--")):
        assert flag in shown, f"{name}: {module} has no {flag}"


def test_bad_values_in_a_step_would_be_refused():
    """The check above is not vacuous: a step naming an unknown strategy would fail it."""
    args = cli.build_parser().parse_args(["bench", "--preset", "full", "--strategies", "fused:zero"])
    with pytest.raises(UserError):
        bench.settings_from_args(args)

"""The GPU plan's commands stay valid for the current CLI (they cannot be run here: no GPU)."""

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


def plan(*args, out=None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"OUT": str(out)} if out else {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def steps(out) -> dict[str, list[str]]:
    done = plan("--dry-run", "all", out=out)
    assert done.returncode == 0, done.stderr
    return {name: shlex.split(command) for name, command in (line.split("\t") for line in done.stdout.splitlines())}


def test_list_names_every_step_with_its_purpose():
    listed = [line.split(None, 1) for line in plan("list").stdout.splitlines()]
    assert [name for name, _ in listed] == ["check", "cnn1000", "vgg9", "models", "cohort10k", "seeds", "placement",
                                            "replicas", "tests"]
    assert all(what.strip() for _, what in listed)


def test_an_unknown_step_is_one_sentence_and_runs_nothing(tmp_path):
    done = plan("cnn1000", "nope", out=tmp_path / "out")
    assert done.returncode == 2 and "step 'nope' is unknown" in done.stderr and "cnn1000" in done.stderr
    assert not (tmp_path / "out").exists()


def test_every_bench_step_parses_and_writes_into_out(tmp_path):
    commands = steps(tmp_path)
    bench_steps = [name for name, argv in commands.items() if argv[1:4] == ["-m", "fedpartial", "bench"]]
    assert set(bench_steps) == {"cnn1000", "vgg9", "models", "cohort10k"}
    for name in bench_steps:
        args = cli.build_parser().parse_args(commands[name][3:])
        settings = bench.settings_from_args(args)  # every model, method and strategy is known
        assert pathlib.Path(args.out).parent == tmp_path and "gpu" in args.out
        assert settings.rounds == 3
    targets = {name: bench.settings_from_args(cli.build_parser().parse_args(commands[name][3:]))
               for name in ("cnn1000", "vgg9")}
    assert targets["cnn1000"].models == ("cnn2c1f",) and targets["cnn1000"].cohorts == (1000,)
    assert targets["vgg9"].models == ("vgg9",)


@pytest.mark.parametrize("name", ["seeds", "placement", "replicas"])
def test_every_benchmark_module_step_names_flags_its_module_takes(tmp_path, name):
    argv = steps(tmp_path)[name]
    module = argv[argv.index("-m") + 1]
    shown = subprocess.run([sys.executable, "-m", module, "--help"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert shown.returncode == 0, shown.stderr
    for flag in (a for a in argv if a.startswith("--")):
        assert flag in shown.stdout, f"{name}: {module} has no {flag}"


def test_bad_values_in_a_step_would_be_refused():
    """The check above is not vacuous: a step naming an unknown strategy would fail it."""
    args = cli.build_parser().parse_args(["bench", "--preset", "full", "--strategies", "fused:zero"])
    with pytest.raises(UserError):
        bench.settings_from_args(args)

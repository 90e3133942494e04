"""``--help`` answers the question asked first, says each thing once, and speaks to users."""

import re

import pytest

from fedpartial._src.cli import flags
from fedpartial._src.cli.main import build_parser
from fedpartial._src.cli.run import RESUME_FLAGS
from fedpartial.methods import METHODS
from tests.test_docs import DOCS_PATH, INTERNAL_WORDS, ROOT


def helps(*argv) -> dict[str, str]:
    """The help of every subcommand, as ``fedpartial SUBCOMMAND *argv --help`` prints it."""
    parser = build_parser(["run", *argv, "--help"])
    subcommands = parser.subcommands.choices
    return {"fedpartial": parser.format_help(), **{name: p.format_help() for name, p in subcommands.items()}}


def test_run_method_help_starts_with_that_methods_options():
    text = helps("--method", "fedldf")["run"]
    groups = [line for line in text.splitlines() if re.match(r"^\S.*:$", line)]
    assert groups[0] == "options of fedldf:", groups[:3]
    body = text.split("\n\n", 1)[1]  # after the usage line
    assert body.index("--n N") < body.index("--help-all") < body.index("--dataset DATASET")


@pytest.mark.parametrize("argv", [(), ("--method", "fedspu"), ("--help-all",)], ids=["plain", "method", "all"])
def test_help_speaks_to_users(argv):
    for command, text in helps(*argv).items():
        words = " ".join(text.split())
        assert not INTERNAL_WORDS.search(words) and not DOCS_PATH.search(words), (command, words)


def test_every_default_is_said_once():
    doubled = [f"{name} {opt.cli_flag}" for name, spec in METHODS.items() for opt in spec.options
               if opt.described().count("default") > 1]
    assert not doubled, doubled
    text = " ".join(helps("--method", "fedspu,heterofl")["run"].split())
    assert text.count("(default: 0.4375,0.1875)") <= 1 and "(default: none) (default" not in text


def test_resume_is_described_the_same_everywhere():
    """--help, the Running experiments page and what the command accepts agree: the run's other flags are
    refused, except the ones that say how this run continues."""
    said = flags.RESUME_HELP.split("; ", 1)[1]
    page = " ".join((ROOT / "docs" / "running.md").read_text().replace("`", "").split())
    assert said in page
    run = build_parser(["run"]).command("run")
    processes = {a.dest for g in run.groups if g.title == "several processes" for a in g.actions}
    assert set(RESUME_FLAGS) == {"resume", "checkpoint_every", "quiet", "rounds"} | processes
    assert all(f"--{dest.replace('_', '-')}" in said for dest in ("checkpoint_every", "quiet", "rounds"))

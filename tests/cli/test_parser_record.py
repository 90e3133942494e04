"""The command line uses argparse through its public API only: what the code reads back from a parser (its
flags, groups, exclusive groups, what the command line gave) comes from the record :class:`Parser` keeps."""

import argparse
import ast
from pathlib import Path

from fedpartial._src.cli import config_file
from fedpartial._src.cli.compare import NOT_COMPARED
from fedpartial._src.cli.main import build_parser, main

PACKAGE = Path(__file__).resolve().parents[2] / "fedpartial"

#: argparse's private names the command line once needed; argparse's own are added from its objects below
KNOWN = {"_actions", "_option_string_actions", "_action_groups", "_positionals", "_optionals", "_group_actions",
         "_get_optional_kwargs", "_registries", "_SubParsersAction", "_StoreAction", "_HelpAction",
         "_ArgumentGroup", "_mutually_exclusive_groups", "_add_action", "_defaults", "_VersionAction",
         "_subparsers"}


def _private_names() -> set[str]:
    """Every private (single-underscore) name of argparse and of the objects it makes."""
    parser = argparse.ArgumentParser()
    made = [argparse, parser, parser.add_argument_group("g"), parser.add_mutually_exclusive_group(),
            parser.add_subparsers(), parser.add_argument("--x"), argparse.HelpFormatter("p"), argparse.Namespace()]
    return KNOWN | {n for obj in made for n in dir(obj) if n.startswith("_") and not n.endswith("__")}


def private_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each use of ``names`` as an attribute (``parser._actions``, ``argparse._HelpAction``) or
    import (``from argparse import _HelpAction``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("_")]
    return found


def test_the_scan_finds_private_uses():
    names = _private_names()
    assert {"_actions", "_group_actions", "_HelpAction", "_get_optional_kwargs"} <= names
    source = ("import argparse\nfrom argparse import _StoreAction\n"
              "def f(parser):\n    return parser._actions, argparse._HelpAction, parser.flags\n")
    assert sorted(private_uses(source, names)) == [(2, "_StoreAction"), (4, "_HelpAction"), (4, "_actions")]


def test_no_argparse_internals_in_the_package():
    names = _private_names()
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, name in private_uses(path.read_text(), names)]
    assert not found, found


def test_given_on_command_line_sees_appended_switched_and_method_flags():
    compare = build_parser(["compare"]).command("compare")
    given = config_file.given_on_command_line(compare, ["--option", "fedldf:n=2", "--quiet", "--rounds", "40"])
    assert given == {"option", "quiet", "rounds"}  # --rounds 40 is the default, given all the same
    run = build_parser(["run"]).command("run")
    assert config_file.given_on_command_line(run, ["--n", "3", "--no-compile-cache"]) == {"option:--n",
                                                                                         "compile_cache"}
    assert config_file.given_on_command_line(run, []) == set()
    assert run.flag("lr").default == 0.05 and compare.flag("option").default == []  # left as they were


def test_compare_declares_run_flags_again_but_its_own():
    parser = build_parser(["compare", "--help-all"])
    run, compare = parser.command("run"), parser.command("compare")
    declared = {a.option_strings[0]: (a.dest, a.default, a.help, a.metavar, a.nargs) for a in compare.flags}
    for action in run.flags:
        if action.dest in NOT_COMPARED or action.dest.startswith("option:"):
            continue
        assert declared[action.option_strings[0]] == (action.dest, action.default, action.help, action.metavar,
                                                      action.nargs)
        assert action not in compare.flags  # its own action: parsing compare never touches run's
    assert "--local-steps" in declared and "--n" not in declared and "--seed" not in declared
    assert [sorted(a.dest for a in g.actions) for g in compare.exclusive] == \
        [sorted(a.dest for a in g.actions) for g in run.exclusive]


def test_compare_resume_refuses_an_option(tmp_path, capsys):
    assert main(["compare", "--resume", str(tmp_path), "--option", "fedldf:n=2"]) == 2
    err = capsys.readouterr().err
    assert "--option cannot be combined with compare --resume" in err and len(err.strip().splitlines()) == 1

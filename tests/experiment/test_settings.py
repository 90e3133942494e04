"""RunConfig's settings are described once: the flags, their help, the TOML keys and the reference page follow."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fedpartial._src.cli.flags import Parser, add_run_flags, config_from_args
from fedpartial._src.cli.main import main
from fedpartial._src.experiment import settings
from fedpartial._src.experiment.config import RunConfig, reference_page

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parser():
    run = Parser(prog="fedpartial run")
    add_run_flags(run)
    return run


def test_every_field_is_described_in_a_known_section():
    for field in dataclasses.fields(RunConfig):
        s = settings.described(field)  # a KeyError here: a field declared without setting(...)
        assert s.section in settings.SECTIONS and s.help.strip(), field.name
        settings.kind(field)  # a type the flags can take
    assert all(settings.fields(RunConfig, name) for name in settings.SECTIONS)  # no empty section


def test_help_of_runconfig_names_every_field_with_its_flag():
    doc = RunConfig.__doc__
    for field in settings.fields(RunConfig):
        line = next(row for row in doc.splitlines() if row.strip().startswith(f"{field.name}:"))
        assert settings.described(field).help in line
        assert settings.flag_of(field) in line


def test_the_flags_are_the_fields(parser):
    """No flags given: the RunConfig of the defaults; every field's flag given: that value reaches the field."""
    assert config_from_args(parser.parse_args([])) == RunConfig()
    argv, expected = [], {}
    samples = {"int": ("7", 7), "float": ("0.375", 0.375), "str": ("xyz", "xyz")}
    taken = set()
    for field in settings.fields(RunConfig):
        flag, kind = settings.flag_of(field), settings.kind(field)
        exclusive = settings.described(field).exclusive
        if not flag or (exclusive is not None and exclusive in taken):
            continue
        taken.add(exclusive)
        if kind == "bool":  # a switch: given, it turns on; one on by default is turned off by --no-
            argv.append(flag if field.default is False else "--no-" + flag[2:])
            expected[field.name] = field.default is False
        else:
            argv += [flag, samples[kind][0]]
            expected[field.name] = samples[kind][1]
    config = config_from_args(parser.parse_args(argv))
    assert {name: getattr(config, name) for name in expected} == expected
    assert len(expected) >= 45


def test_messages_and_help_name_the_flag_people_type(parser):
    help_text = parser.format_help()
    for field in settings.fields(RunConfig):
        if settings.flag_of(field):
            assert settings.flag_of(field) in help_text
    assert settings.flag_of("num_clients", RunConfig) == "--clients"
    assert settings.flag_of("early_stopping", RunConfig) == "--es"
    with pytest.raises(settings.ConfigError, match="^--cohort 30 is not allowed"):
        RunConfig(cohort_size=30).validate()


def test_reference_page_is_generated_from_the_code():
    page = (ROOT / "docs" / "configuration.md").read_text()
    expected = reference_page()
    assert page == expected, ("docs/configuration.md is stale: regenerate it with "
                              "python -m fedpartial._src.experiment.config > docs/configuration.md")
    for title, _ in settings.SECTIONS.values():
        assert f"## {title}" in page
    assert "`--n`" in page and "`fedldf`" in page  # method options are there too


def test_list_options_shows_one_methods_options(capsys):
    assert main(["list", "options", "fedldf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fedldf:") and "--n" in out and "(default: 4)" in out
    assert main(["list", "methods", "--options"]) == 0
    out = capsys.readouterr().out
    assert "--mu" in out and "--tiers" in out
    assert main(["list", "options"]) == 2
    assert "give a method after options" in capsys.readouterr().err


def test_a_settings_words_show_flags_commands_and_paths_as_code():
    marked = settings.code_marked
    assert marked("drawn with --seed (fedpartial list datasets)") == "drawn with `--seed` (`fedpartial list datasets`)"
    assert marked("its flag (fedpartial run --method NAME --help)") == "its flag (`fedpartial run --method NAME --help`)"
    assert marked("in $TMPDIR or ~/.cache/fedpartial/jax") == "in `$TMPDIR` or `~/.cache/fedpartial/jax`"
    assert marked("a fedpartial run folder, 1e-3, non-IID, `--es` already") == \
        "a fedpartial run folder, 1e-3, non-IID, `--es` already"
    page = reference_page()
    assert "| 0.7 when the method or `--es` needs held-out data, else 1 |" in page

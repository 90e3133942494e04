"""benchmarks/suite_profile.py: its recorder sees JAX's programs and phases, and its summary counts them as
worked out by hand."""

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import suite_profile


def test_the_summary_by_hand(tmp_path):
    records = [
        {"test": "tests/a.py::one", "wall": 2.0, "cpu": 1.5,
         "events": [["trace", 0.2], ["lower", 0.3], ["program", "jit_round", "k1"], ["compile", 1.0],
                    ["trace", 0.1], ["program", "jit_add", "k2"], ["compile", 0.05]]},
        {"test": "tests/b.py::two", "wall": 1.0, "cpu": 0.5,
         "events": [["trace", 0.25], ["lower", 0.5], ["program", "jit_round", "k1"], ["cache_read", 0.04]]},
    ]
    (tmp_path / "gw0.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    s = suite_profile.summarize(suite_profile.read(tmp_path))
    assert s["tests"] == 2
    assert s["seconds"] == {"wall": 3.0, "cpu": 2.0, "trace": 0.55, "lower": 0.8, "compile": 1.05, "cache_read": 0.04}
    # jit_round lowered twice (keys, not names, decide): the second lowering's 0.75 s is the repeat
    assert s["programs"] == {"distinct": 2, "requests": 3, "lowered_more_than_once": 1,
                             "repeat_trace_and_lower_seconds": 0.75}
    assert s["most_repeated"] == [{"name": "jit_round", "lowered": 2, "repeat_seconds": 0.75,
                                   "files": ["tests/a.py", "tests/b.py"]}]
    assert s["by_program_name"]["jit_round"] == {"requests": 2, "compile": 1.0, "compiles": 1, "cache_read": 0.04,
                                                 "cache_reads": 1}
    assert list(s["files"]) == ["tests/a.py", "tests/b.py"]  # the longest first
    assert s["files"]["tests/a.py"] == {"tests": 1, "wall": 2.0, "cpu": 1.5, "trace": 0.3, "lower": 0.3,
                                        "compile": 1.05}


def test_the_recorder_sees_each_lowering_and_leaves_jax_as_it_was(tmp_path):
    """Two fresh closures of the same function: one program, lowered twice (the persistent cache of
    tests/conftest.py gives both the same key); nothing is recorded once the recorder is removed."""
    x = jnp.arange(7.0)
    recorder = suite_profile.Recorder(tmp_path)
    recorder.install()
    try:
        for _ in range(2):
            jax.jit(lambda x: jnp.sin(x) * 3.0)(x).block_until_ready()
    finally:
        recorder.remove()
    programs = [e for e in recorder.events if e[0] == "program"]
    assert len(programs) == 2 and programs[0] == programs[1] and programs[0][2] is not None
    phases = {e[0] for e in recorder.events} - {"program"}
    assert {"trace", "lower"} <= phases and phases <= set(suite_profile.PHASES)
    recorder.events = []
    jax.jit(lambda x: jnp.cos(x) * 5.0)(x).block_until_ready()
    assert recorder.events == []


def test_an_empty_folder_is_one_sentence(tmp_path):
    with pytest.raises(SystemExit, match="holds no test records"):
        suite_profile.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="is not a folder"):
        suite_profile.main([str(tmp_path / "missing")])


def test_the_plugin_writes_one_record_per_test_and_the_summary_names_its_file(tmp_path, monkeypatch):
    """The pytest hooks as pytest calls them where a test runs: configure, one test's protocol, unconfigure;
    then the command-line summary of the folder, written where ``--out`` says."""
    monkeypatch.setenv(suite_profile.ENV, str(tmp_path / "prof"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    # the suite may be profiled itself (the plugin loaded, its recorder this module's): set aside until the end
    monkeypatch.setattr(suite_profile, "_recorder", None)
    item = type("Item", (), {"nodeid": "tests/x.py::test_y"})()
    x = jnp.arange(5.0)
    suite_profile.pytest_configure(None)
    try:
        protocol = suite_profile.pytest_runtest_protocol(item, None)
        next(protocol)  # the test runs here
        jax.jit(lambda x: jnp.tanh(x) + 2.0)(x).block_until_ready()
        with pytest.raises(StopIteration):
            next(protocol)
    finally:
        suite_profile.pytest_unconfigure(None)
    assert suite_profile._recorder is None
    (record,) = [json.loads(line) for line in (tmp_path / "prof" / "gw7.jsonl").read_text().splitlines()]
    assert record["test"] == "tests/x.py::test_y" and record["wall"] > 0
    assert [e[1] for e in record["events"] if e[0] == "program"] == ["jit__lambda"]
    out = tmp_path / "summary.json"
    suite_profile.main([str(tmp_path / "prof"), "--out", str(out)])
    summary = json.loads(out.read_text())
    assert summary["benchmark"] == "suite_profile" and summary["device"]["platform"] == "cpu"
    assert summary["tests"] == 1 and list(summary["files"]) == ["tests/x.py"]
    assert summary["programs"]["requests"] == 1
    speed = summary["machine_speed_seconds"]  # the speed the numbers were measured at, to compare profiles
    assert set(speed) == {"python", "compile"} and 0 < speed["python"] < 60 and 0 < speed["compile"] < 60

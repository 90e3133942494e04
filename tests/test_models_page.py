"""The Models page (``docs/models.md``) claims only what can be checked: each parameter count of the zoo table is
the model's, counted from its shapes (``jax.eval_shape``, nothing run), the layer sizes it names are the model's,
and the numbers it quotes from a result file are those of the file (the lowering speed-ups:
``tests/test_docs.py``)."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.models import resnet
from fedpartial._src.models.registry import MODELS, build_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
ROW = re.compile(r"^\| `(?P<name>\w+)` \|(?P<layers>[^|\n]*)\|(?P<params>[^|\n]*)\|(?P<notes>[^|\n]*)\|$", re.MULTILINE)
COUNT = re.compile(r"^(?P<count>\d{1,3}(?:,\d{3})*) \((?P<input>[^,]+), (?P<classes>\d+)[^)]*\)$")


def zoo_rows() -> dict[str, dict]:
    return {m["name"]: {k: v.strip() for k, v in m.groupdict().items()} for m in ROW.finditer(PAGE)}


def shapes(module, input_shape, dtype=jnp.float32) -> dict[str, tuple]:
    """``{'fc1/kernel': shape}`` of a module's parameters, from ``jax.eval_shape`` (nothing computed)."""
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((2, *input_shape), dtype))
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])}


def count(module, input_shape, dtype=jnp.float32) -> int:
    return int(sum(np.prod(s) for s in shapes(module, input_shape, dtype).values()))


def parse_input(text: str) -> tuple[tuple[int, ...], object]:
    """``8×8×1`` -> ((8, 8, 1), float32); ``80 character ids`` -> ((80,), int32)."""
    if "×" in text:
        return tuple(int(d) for d in text.split("×")), jnp.float32
    return (int(re.match(r"(\d+) \w+ ids$", text).group(1)),), jnp.int32


def test_the_zoo_table_lists_every_zoo_model_in_one_table():
    assert sorted(zoo_rows()) == sorted(MODELS)
    table = PAGE[PAGE.index("| name | layers |"):PAGE.index("`resnet20`, `bilstm` and the two LSTMs")]
    assert "\n\n|" not in table.strip(), "a blank line splits the zoo table"


@pytest.mark.parametrize("name", sorted(n for n, row in zoo_rows().items() if COUNT.match(row["params"])))
def test_each_parameter_count_of_the_zoo_table_is_the_models(name):
    m = COUNT.match(zoo_rows()[name]["params"])
    input_shape, dtype = parse_input(m["input"])
    classes = int(m["classes"])
    assert count(build_model(name, classes, input_shape), input_shape, dtype) == int(m["count"].replace(",", ""))


def test_resnet20s_counts_and_embracingfls():
    row = zoo_rows()["resnet20"]
    projection, zeros = (int(x.replace(",", "")) for x in re.findall(r"\d{1,3}(?:,\d{3})+", row["params"]))
    assert count(build_model("resnet20", 10, (32, 32, 3)), (32, 32, 3)) == projection
    assert count(resnet.ResNet20(num_classes=10, shortcut="zeros"), (32, 32, 3)) == zeros
    # the paper's count is ours and the 1×1 16→16 conv (and its BatchNorm) the notes name
    paper = int(re.search(r"EmbracingFL counts (\d{1,3}(?:,\d{3})+)", row["notes"]).group(1).replace(",", ""))
    assert paper - projection == 1 * 1 * 16 * 16 + 2 * 16
    # lenet5's note quotes FedDHAD's count, which is ours
    assert f"{count(build_model('lenet5', 10, (32, 32, 3)), (32, 32, 3)):,}" in zoo_rows()["lenet5"]["notes"]


def test_the_layer_sizes_the_zoo_table_names_are_the_models():
    rows = zoo_rows()
    mlp = shapes(build_model("mlp", 10, (8, 8, 1)), (8, 8, 1))
    assert rows["mlp"]["layers"] == "200-200" and mlp["fc1/kernel"][1] == mlp["fc2/kernel"][1] == 200
    cnn = shapes(build_model("cnn2c1f", 10, (8, 8, 1)), (8, 8, 1))
    assert "32/64 5×5" in rows["cnn2c1f"]["notes"]
    assert cnn["conv1/kernel"] == (5, 5, 1, 32) and cnn["conv2/kernel"] == (5, 5, 32, 64)
    lstm = shapes(build_model("shakespeare_lstm", 81, (80,)), (80,), jnp.int32)
    assert rows["shakespeare_lstm"]["layers"].startswith("embedding 8, 2 LSTM of 256")
    assert lstm["embedding/embedding"][1] == 8 and lstm["lstm1/kernel_h"][0] == lstm["lstm2/kernel_h"][0] == 256
    sent = shapes(build_model("sent140_lstm", 2, (25,)), (25,), jnp.int32)
    assert rows["sent140_lstm"]["layers"].startswith("embedding 300, 2 LSTM of 100, dense 30")
    assert sent["embedding/embedding"][1] == 300 and sent["lstm2/kernel_h"][0] == 100 and sent["fc1/kernel"][1] == 30
    for name, input_shape in (("transformer_lm", (32,)), ("transformer_cls", (64,)), ("vit", (8, 8, 1))):
        assert "2 pre-LN blocks" in rows[name]["layers"]
        dtype = jnp.float32 if name == "vit" else jnp.int32
        blocks = {k.split("/")[0] for k in shapes(build_model(name, 2, input_shape), input_shape, dtype)}
        assert sorted(b for b in blocks if b.startswith("block")) == ["block0", "block1"], name
    cls = shapes(build_model("transformer_cls", 2, (64,)), (64,), jnp.int32)
    assert "(10,000 ids)" in rows["transformer_cls"]["notes"] and cls["embed/embedding"][0] == 10_000
    # ViT: 2×2 patches on digits (8×8×1), 4×4 on MNIST (28×28×1): the patch embedding reads h·w·c values
    assert "2×2 patches on digits, 4×4 on MNIST" in rows["vit"]["notes"]
    assert shapes(build_model("vit", 10, (8, 8, 1)), (8, 8, 1))["embed/kernel"][0] == 2 * 2 * 1
    assert shapes(build_model("vit", 10, (28, 28, 1)), (28, 28, 1))["embed/kernel"][0] == 4 * 4 * 1


def test_resnet20s_stages_are_the_stem_nine_blocks_and_the_head():
    assert "(ResNet20 at block boundaries: `stem`, nine blocks,\n`head`)" in PAGE
    names = build_model("resnet20", 10, (32, 32, 3)).stage_names
    assert len(names) == 11 and names[0] == "stem" and names[-1] == "head"


def test_the_im2col_patch_size_is_the_cnns():
    page = " ".join(PAGE.split())
    cnn = shapes(build_model("cnn2c1f", 10, (28, 28, 1)), (28, 28, 1))
    assert cnn["conv2/kernel"] == (5, 5, 32, 64)
    size = 10 * 16 * 14 * 14 * 5 * 5 * 32 * 4  # clients, examples, positions after the first pool, taps, bytes
    assert "10 × 16 × 14 × 14 positions × 5 × 5 × 32 taps × 4 bytes ≈ 100 MB" in page and round(size / 1e6) == 100


def test_the_bfloat16_sentence_is_the_result_files():
    name = "conv-lowering-cpu-bf16.json"
    results = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["results"]
    cells = {(r["row"], r["dtype"]): r["cells"] for r in results}
    ratios = {(row, cell): cells[row, "bfloat16"][cell]["rounds_per_s"] / v["rounds_per_s"]
              for (row, dtype), by in cells.items() if dtype == "float32" for cell, v in by.items()}
    slower = [x for x in ratios.values() if x < 0.95]
    level = [x for x in ratios.values() if 0.95 <= x <= 1.05]
    faster = {key: x for key, x in ratios.items() if x > 1.05}
    assert list(faster) == [("cnn2c1f@8x8x1:10", "lax/stepwise:1")]
    page = " ".join(PAGE.split())
    assert (f"`benchmarks/results/{name}`" in page and f"slower in {len(slower)} of {len(ratios)} "
            f"({min(slower):.2f}–{max(slower):.2f}× float32's rounds/s), level in {len(level)} and faster in "
            f"{len(faster)} (lax on 8×8 digits, {max(faster.values()):.1f}×)" in page), ratios

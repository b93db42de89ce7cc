"""Training data: discovery and captions, aspect-ratio buckets, image loading, batch sampling.

`build(cfg.datasets, family_bucket_step)` gives a `DataSet` of `Item`s; `BucketBatchSampler`
orders them into single-bucket batches; `crop_box` and `load_pixels` turn an item into pixels.
"""

from difftune.data.buckets import assign_bucket, cover_size, make_buckets, square_bucket
from difftune.data.discover import IMAGE_EXTENSIONS, DataSet, Item, build, read_caption
from difftune.data.images import crop_box, load_pixels, probe_image
from difftune.data.sampler import Batch, BucketBatchSampler

__all__ = [
    "IMAGE_EXTENSIONS",
    "Batch",
    "BucketBatchSampler",
    "DataSet",
    "Item",
    "assign_bucket",
    "build",
    "cover_size",
    "crop_box",
    "load_pixels",
    "make_buckets",
    "probe_image",
    "read_caption",
    "square_bucket",
]

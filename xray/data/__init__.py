"""Data that crosses Ray calls: the Batch type and its column names."""
from xray.data.batch import Batch, BatchError

__all__ = ["Batch", "BatchError"]

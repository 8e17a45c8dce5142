"""The trainer's data (interim facade while the room is laid out; see model/data/loader.py)."""

from model.data.loader import BatchLoader, DataError, Dataset, Tokenizer, load_dataset, main, validation_batches

__all__ = ["BatchLoader", "DataError", "Dataset", "Tokenizer", "load_dataset", "main", "validation_batches"]

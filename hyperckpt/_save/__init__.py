"""Saving a state dict of any DTensor layout as a Hugging Face checkpoint, every rank its bytes."""

from hyperckpt._save.api import SaveReport, save
from hyperckpt._save.options import SaveOptions
from hyperckpt._save.writer import HuggingFaceStorageWriter

__all__ = ["HuggingFaceStorageWriter", "SaveOptions", "SaveReport", "save"]

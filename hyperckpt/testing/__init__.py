"""Hypothesis strategies that build safetensors checkpoints, valid or with one fault.

Needs the ``testing`` extra (``pip install hyperckpt[testing]``, which brings hypothesis);
``import hyperckpt`` itself never imports this package.  Use it to property-test code that
writes or reads checkpoints, with hyperckpt as the validator::

    from hypothesis import given
    from hyperckpt import describe
    from hyperckpt.testing import file_faults, safetensors_files, torch_sharded_checkpoints

    @given(torch_sharded_checkpoints())
    def test_my_loader(tmp_path_factory, checkpoint):
        root = checkpoint.write(tmp_path_factory.mktemp("ckpt"))
        layout = describe(root)            # validates; a fault would raise CheckpointError
        ...

What is here:

* files: :func:`safetensors_files` (valid files across every loadable dtype, 0-d and
  zero-size tensors included, returning the bytes and the :class:`TensorSpec` of each
  tensor), :func:`tensor_specs`, :func:`file_of` and :func:`encode_file` to build files by
  hand (:class:`Pairs` writes an object with repeated keys), :func:`to_torch` for the
  expected tensor;
* tilings: :func:`tilings`, :func:`grid_tilings`, :func:`guillotine_tilings` (exact tilings
  of a shape into :class:`Block` boxes) and :func:`slice_bytes`;
* directories: :func:`huggingface_checkpoints` (one file, or several with an index) and
  :func:`torch_sharded_checkpoints` (per-rank files with ``DCP_SHARDING_INFO``), each with
  a ``write(root)`` method;
* faults: :func:`file_faults` (one broken rule of one file), :func:`huggingface_faults`
  (a missing file, an index disagreeing with the files, a tensor in two files, ...) and
  :func:`sharded_faults` (a removed, shifted or duplicated piece), each naming the id of
  the rule it breaks; the rules and their messages are catalogued in
  ``docs/rules.md``.
"""

from __future__ import annotations

from hyperckpt.testing._directories import (
    BYTE_DTYPES,
    HuggingFaceCheckpoint,
    StoredPiece,
    TorchShardedCheckpoint,
    huggingface_checkpoints,
    shard_file,
    shard_file_name,
    torch_sharded_checkpoint,
    torch_sharded_checkpoints,
    write_files,
)
from hyperckpt.testing._files import (
    LOADABLE_DTYPES,
    Pairs,
    SafetensorsFile,
    TensorSpec,
    encode_file,
    encode_json,
    file_of,
    safetensors_files,
    tensor_names,
    tensor_specs,
    to_torch,
)
from hyperckpt.testing._hf_faults import HF_FAULT_RULES, HuggingFaceFault, huggingface_faults
from hyperckpt.testing._mutations import (
    FILE_FAULT_RULES,
    FileFault,
    ShardedFault,
    file_faults,
    sharded_faults,
)
from hyperckpt.testing._tilings import (
    Block,
    grid_tilings,
    guillotine_tilings,
    slice_bytes,
    tilings,
)

__all__ = [
    "BYTE_DTYPES",
    "FILE_FAULT_RULES",
    "HF_FAULT_RULES",
    "LOADABLE_DTYPES",
    "Block",
    "FileFault",
    "HuggingFaceCheckpoint",
    "HuggingFaceFault",
    "Pairs",
    "SafetensorsFile",
    "ShardedFault",
    "StoredPiece",
    "TensorSpec",
    "TorchShardedCheckpoint",
    "encode_file",
    "encode_json",
    "file_faults",
    "file_of",
    "grid_tilings",
    "guillotine_tilings",
    "huggingface_checkpoints",
    "huggingface_faults",
    "safetensors_files",
    "shard_file",
    "shard_file_name",
    "sharded_faults",
    "slice_bytes",
    "tensor_names",
    "tensor_specs",
    "tilings",
    "to_torch",
    "torch_sharded_checkpoint",
    "torch_sharded_checkpoints",
    "write_files",
]

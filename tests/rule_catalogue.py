"""The catalogue of every rule hyperckpt enforces, each with a minimal checkpoint breaking it.

``docs/rules.md`` is generated from it (``python tests/rule_catalogue.py docs/rules.md``)
and a test checks the page is current, so the examples there are real messages.

Longer than the package's other modules on purpose: it is one table, a row and a provoking
example per rule, read top to bottom like the page it generates (the save rules' examples
live in ``_save_rules``).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from save_rules import SAVE_RULES

from hyperckpt._layout.directory import describe_directory as describe
from hyperckpt._layout.directory import huggingface_layout, torch_sharded_layout
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError
from hyperckpt.testing._directories import INDEX_NAME, shard_file, write_files
from hyperckpt.testing._files import Pairs, encode_file

__all__ = ["RULES", "Rule", "provoke", "render_rules_page"]


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule and how to break it.

    Attributes:
        id: Stable id, e.g. ``"offsets.span"``; mutations name the rule they break by it.
        summary: The rule in a sentence.
        error: The error type raised when it is broken.
        pattern: A regular expression every message for this rule matches (the text is
            for people; tools and tests match ``id``, which the error carries as ``rule``).
        trigger: Writes a checkpoint breaking the rule into a fresh directory and loads it.
    """

    id: str
    summary: str
    error: type[CheckpointError]
    pattern: str
    trigger: Callable[[Path], object]

    def matches(self, err: BaseException) -> bool:
        """Whether ``err`` is this rule's error: of its type and carrying its id.

        An error that carries no id (``rule`` is ``None``) is matched by its message
        instead, against :attr:`pattern`.
        """
        if not isinstance(err, self.error):
            return False
        if err.rule is not None:
            return err.rule == self.id
        return re.search(self.pattern, str(err)) is not None


_ENTRY = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}


def _one_file(
    header: Mapping[str, object] | Pairs | str | bytes,
    data: bytes = b"\0\0",
    *,
    length: int | None = None,
) -> Callable[[Path], object]:
    def trigger(root: Path) -> object:
        write_files(root, {"model.safetensors": encode_file(header, data, length=length)})
        return describe(root)

    return trigger


def _raw_file(data: bytes) -> Callable[[Path], object]:
    def trigger(root: Path) -> object:
        write_files(root, {"model.safetensors": data})
        return describe(root)

    return trigger


def _tensor(header: object) -> Callable[[Path], object]:
    return _one_file(Pairs([("w", header)]), b"")


def _shard(
    tensors: Mapping[str, tuple[str, list[int], list[int]]], info: str | None = None
) -> bytes:
    return shard_file(tensors, info=info)


def _sharded(files: Mapping[str, bytes]) -> Callable[[Path], object]:
    def trigger(root: Path) -> object:
        write_files(root, files)
        return torch_sharded_layout(root)

    return trigger


def _hf(files: Mapping[str, bytes], index: object = None) -> Callable[[Path], object]:
    def trigger(root: Path) -> object:
        extra = {}
        if index is not None:
            raw = index if isinstance(index, bytes) else json.dumps(index).encode()
            extra[INDEX_NAME] = raw
        write_files(root, {**files, **extra})
        return huggingface_layout(root)

    return trigger


def _two_files(index: object, b: Mapping[str, object] | None = None) -> Callable[[Path], object]:
    a_bytes = encode_file({"a": _ENTRY}, b"\0\0")
    b_bytes = encode_file({"b": _ENTRY} if b is None else b, b"\0\0")
    return _hf({"m-1.safetensors": a_bytes, "m-2.safetensors": b_bytes}, index)


def _broken_symlink(root: Path) -> object:
    root.mkdir(parents=True)
    os.symlink(root / "gone.safetensors", root / "shard-00001-model-00001-of-00001.safetensors")
    return torch_sharded_layout(root)


def _not_regular(root: Path) -> object:
    (root / "shard-00001-model-00001-of-00001.safetensors").mkdir(parents=True)
    return torch_sharded_layout(root)


def _fifo(root: Path) -> object:
    os.mkfifo(root)
    return describe(root)


def _not_regular_index(root: Path) -> object:
    (root / INDEX_NAME).mkdir(parents=True)
    return describe(root)


def _big_index(root: Path) -> object:
    root.mkdir(parents=True)
    with open(root / INDEX_NAME, "wb") as f:
        f.truncate(100_000_001)  # sparse: costs no disk
    return describe(root)


_LFS_POINTER = (
    b"version https://git-lfs.github.com/spec/v1\n"
    b"oid sha256:2ef8b4c8a1b2a6c9d8f7e6d5c4b3a2918273645546372819a0b1c2d3e4f5a6b7\n"
    b"size 4976698672\n"
)  # what a clone without `git lfs pull` leaves in place of a weight file


def _torch_saved(root: Path) -> object:
    import torch

    root.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, root / "pytorch_model.bin")
    return describe(root / "pytorch_model.bin")


def _json_file(root: Path) -> object:
    write_files(root, {"config.json": b'{\n  "model_type": "llama"\n}\n'})
    return describe(root / "config.json")


def _torch_dcp(root: Path) -> object:
    import warnings

    import torch
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():  # one process without a process group: meant so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        save({"w": torch.zeros(2)}, checkpoint_id=root, no_dist=True)
    return describe(root)


def _diffusers_pipeline(root: Path) -> object:
    write_files(root, {"model_index.json": b"{}"})
    write_files(root / "unet", {"diffusion_pytorch_model.safetensors": encode_file({})})
    write_files(root / "text_encoder", {"model.safetensors": encode_file({})})
    write_files(root / "scheduler", {"scheduler_config.json": b"{}"})
    return describe(root)


def _f4_mid_byte(root: Path) -> object:
    # Only an empty F4 tensor can have a piece at an odd column: even widths tile from 0.
    write_files(root, {"shard-00001-a.safetensors": _shard({"w": ("F4", [0, 2], [0, 1])})})
    return describe(root)


def _too_complex(root: Path) -> object:
    # Two one-element pieces at opposite corners of a 2**22-element box: cut along 22 dims.
    ndim = 22
    write_files(
        root,
        {
            _SHARD_A: _shard({"w": ("U8", [1] * ndim, [0] * ndim)}),
            _SHARD_B: _shard({"w": ("U8", [1] * ndim, [1] * ndim)}),
        },
    )
    return torch_sharded_layout(root)


def _shape_larger(root: Path) -> object:
    import torch

    from hyperckpt._load.api import load

    # The file with rows 2:4 is missing: the tensor looks like 2 rows, the model wants 4.
    write_files(root, {_SHARD_A: _shard({"w": ("U8", [2, 2], [0, 0])})})
    return load({"w": torch.zeros(4, 2, dtype=torch.uint8)}, root)


def _checkpoint_and_sums(root: Path, listed: str | None = None) -> Path:
    """A one-file checkpoint at ``root``; returns where its checksum file goes (beside it),
    written with ``listed`` as its only path when given."""
    write_files(root, {"model.safetensors": encode_file({"w": _ENTRY}, b"\0\0")})
    sums = root.parent / "SHA256SUMS"
    if listed is not None:
        sums.write_text(f"{'0' * 64}  {listed}\n", encoding="utf-8")
    return sums


def _outside_folder(root: Path) -> object:
    from hyperckpt._verify.run import verify

    sums = _checkpoint_and_sums(root, "sub/secret.bin")
    write_files(root.parent / "elsewhere", {"secret.bin": b"x"})
    (root / "sub").symlink_to(root.parent / "elsewhere", target_is_directory=True)
    return verify(root, checksums=sums)


def _checksums_fifo(root: Path) -> object:
    from hyperckpt._verify.run import verify

    sums = _checkpoint_and_sums(root)
    os.mkfifo(sums)
    return verify(root, checksums=sums)


def _checksums_big(root: Path) -> object:
    from hyperckpt._verify.run import verify

    sums = _checkpoint_and_sums(root)
    with open(sums, "wb") as f:
        f.truncate(100_000_001)  # sparse: costs no disk
    return verify(root, checksums=sums)


def _torn_save(root: Path) -> object:
    """A save's temporary folder, as a killed coordinator leaves it, read by its path."""
    from hyperckpt._storage.outputs import join_temp_dir

    root.mkdir(parents=True)
    temp = join_temp_dir(root / "ckpt", "0123456789ab")
    write_files(temp, {"model.safetensors": encode_file({"w": _ENTRY}, b"\0\0")})
    return describe(temp)


def _existing_save(root: Path) -> object:
    import torch

    from hyperckpt._save.api import save

    save({"w": torch.ones(2)}, root)
    return save({"w": torch.ones(2)}, root)


def _file_as_output(root: Path) -> object:
    import torch

    from hyperckpt._save.api import save

    root.parent.mkdir(parents=True, exist_ok=True)
    root.write_bytes(b"notes")
    return save({"w": torch.ones(2)}, root, overwrite=True)


def _url_save(root: Path) -> object:
    import torch

    from hyperckpt._save.api import save

    return save({"w": torch.ones(2)}, "gs://bucket/run/step-100")


def _empty_save(root: Path) -> object:
    import torch

    from hyperckpt._save.api import save

    return save({"w": torch.ones(2)}, "")


def _planted_link(root: Path) -> object:
    from hyperckpt._storage.files import LocalStorage

    root.mkdir(parents=True)
    (root / "model.safetensors").symlink_to(root.parent / "victim")
    return LocalStorage(root).create_exclusive("model.safetensors")


def _marker_link(root: Path) -> object:
    from hyperckpt._consolidate.run import MARKER_NAME, consolidate

    source = write_files(root / "sharded", {_SHARD_A: _shard({"w": ("U8", [2], [0])})})
    (root / "out").mkdir()
    (root / "out" / MARKER_NAME).symlink_to(root.parent / "victim")
    return consolidate(source, root / "out")


def _input_in_output(root: Path) -> object:
    from hyperckpt._consolidate.run import consolidate

    # A shard of the input is a link to the output file of an earlier run.
    out = write_files(root / "out", {"model.safetensors": _shard({"w": ("U8", [2], [0])})})
    (root / "sharded").mkdir()
    (root / "sharded" / _SHARD_A).symlink_to(out / "model.safetensors")
    return consolidate(root / "sharded", out, overwrite=True)


def _long_names(root: Path, count: int, length: int, like: bool) -> object:
    """Plan the consolidation of ``count`` one-byte tensors with names ``length`` long (no
    file is needed: planning is pure)."""
    from hyperckpt._consolidate.assign import plan_output
    from hyperckpt._layout.model import Piece, TensorLayout

    names = [chr(ord("a") + n) * length for n in range(count)]
    tensors = {
        name: TensorLayout(name, "U8", (1,), (Piece(_SHARD_A, (0,), (1,), 0, 1),)) for name in names
    }
    assignment = (dict.fromkeys(names, "model.safetensors"), False) if like else None
    return plan_output(tensors, like=assignment)


def _missing_key(root: Path) -> object:
    import torch

    from hyperckpt._load.api import load

    # lm_head.weight is missing, and allow_missing names "lm_head", which is no key.
    write_files(root, {"model.safetensors": encode_file({"embed.weight": _ENTRY}, b"\0\0")})
    state = {"embed.weight": torch.zeros(2, dtype=torch.uint8), "lm_head.weight": torch.zeros(2)}
    return load(state, root, allow_missing={"lm_head"})


def _tied_differ(root: Path) -> object:
    import torch

    from hyperckpt._load.api import load

    # Both stored, with different values, into one memory (tied in the model).
    header = {"embed.weight": _ENTRY, "lm_head.weight": {**_ENTRY, "data_offsets": [2, 4]}}
    write_files(root, {"model.safetensors": encode_file(header, b"\0\0\1\1")})
    shared = torch.zeros(2, dtype=torch.uint8)
    return load({"embed.weight": shared, "lm_head.weight": shared}, root)


# JSON bombs inside a string and in the index: 2**20 characters of empty arrays.
_ARRAY_BOMB = "[" + "[]," * (2**20 // 3) + "[]]"


def _mapped(
    tensors: Mapping[str, tuple[str, list[int]]], mapping: object
) -> Callable[[Path], object]:
    """A checkpoint of ``tensors`` (name to 2-byte dtype and shape) seen through ``mapping``."""
    from hyperckpt._layout.mapping import as_mapping

    def trigger(root: Path) -> object:
        header: dict[str, object] = {}
        position = 0
        for name, (dtype, shape) in tensors.items():
            size = 2 * math.prod(shape)
            header[name] = {
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [position, position + size],
            }
            position += size
        write_files(root, {"model.safetensors": encode_file(header, b"\0" * position)})
        return as_mapping(mapping).apply(describe(root))

    return trigger


def _renamed_from_a_table(name: str) -> str:
    """A user's rename function that knows only some names (raises ``KeyError``)."""
    return {"v": "value"}[name]


def _saved_through_a_function(root: Path) -> object:
    """A save whose mapping renames through a function, which has no inverse."""
    import torch

    from hyperckpt._save.api import save

    return save({"w": torch.ones(2)}, root / "saved", mapping=_renamed_from_a_table)


def _saved_qkv(shapes: dict[str, tuple[int, ...]]) -> Callable[[Path], object]:
    """A save with ``mapping="qkv-proj"`` of tensors of these shapes."""

    def trigger(root: Path) -> object:
        import torch

        from hyperckpt._save.api import save

        state = {name: torch.zeros(shape) for name, shape in shapes.items()}
        return save(state, root / "saved", mapping="qkv-proj")

    return trigger


def _expert(shape: list[int], dtype: str = "BF16") -> tuple[str, list[int]]:
    return dtype, shape


_X = "m.experts"
_SHARD_A = "shard-00001-model-00001-of-00001.safetensors"
_SHARD_B = "shard-00002-model-00001-of-00001.safetensors"
_SHARD_D = "shard-00004-model-00001-of-00001.safetensors"
_INFO = '{"w": {"saved_offsets": [0]}}'
_MAP = {"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}

_E = CheckpointError
_NF = CheckpointNotFoundError

#: Every rule, in the order the checks run: one file, then the directory kinds.
_READ_RULES: tuple[Rule, ...] = (
    Rule("file.too_small", "A file holds at least the 8-byte header length.", _E,
         r"is too small for a safetensors file", _raw_file(b"\x02\0\0")),
    Rule("file.lfs_pointer", "A Git LFS pointer in place of a file (a clone without `git lfs "
         "pull`) is named as such, with how to fetch the data.", _E,
         r"a Git LFS pointer .* git lfs pull", _raw_file(_LFS_POINTER)),
    Rule("file.torch_pickle", "A `torch.save` file (zip or legacy pickle, e.g. `pytorch_model.bin`) "
         "given as a checkpoint is named as such, with how to convert it.", _E,
         r"never unpickles", _torch_saved),
    Rule("file.other_format", "A JSON or GGUF file given as a checkpoint is named as such.", _E,
         r"a (JSON text|GGUF) file, not safetensors", _json_file),
    Rule("header.too_long", "The header length is at most 100,000,000 bytes.", _E,
         r"exceeds the format's limit", _one_file("{}", length=100_000_001)),
    Rule("header.past_end", "The header lies within the file.", _E,
         r"runs past the end of the", _one_file("{}", b"", length=40)),
    Rule("header.not_utf8", "The header is UTF-8.", _E,
         r"header is not valid UTF-8", _one_file(b'{"\xff": 1}', b"")),
    Rule("header.not_json", "The header is JSON (no NaN or Infinity).", _E,
         r"header is not valid JSON", _one_file('{"w": ', b"")),
    Rule("header.not_object", "The header is a JSON object.", _E,
         r"header is a JSON \w+, not an object", _one_file("[]", b"")),
    Rule("header.too_many_tokens", "A large header has no more strings, arrays or objects "
         "than real headers carry (bounds parsing memory).", _E,
         r"far more (strings|containers) than a real header can hold",
         _one_file("[" + '"",' * 400_000 + '""]', b"")),
    Rule("json.duplicate_key", "No JSON object repeats a key, at any level.", _E,
         r"has the key .* twice",
         _one_file(Pairs([("w", _ENTRY), ("w", _ENTRY)]))),
    Rule("json.too_deep", "The header is not absurdly nested.", _E,
         r"nested too deeply", _one_file("[" * 100_000 + "]" * 100_000, b"")),
    Rule("metadata.not_object", "`__metadata__` is absent, null or an object, never a tensor.", _E,
         r"__metadata__ (must be an object of strings or null|looks like a tensor entry)",
         _one_file({"__metadata__": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}, b"")),
    Rule("metadata.not_string", "Every `__metadata__` value is a string.", _E,
         r"__metadata__\[.*\] must be a string", _one_file({"__metadata__": {"step": 10}}, b"")),
    Rule("metadata.lone_surrogate", "`__metadata__` strings are Unicode (no lone surrogates).", _E,
         r"holds a lone surrogate escape", _one_file('{"__metadata__": {"a": "\\ud800"}}', b"")),
    Rule("entry.not_object", "Each tensor entry is an object.", _E,
         r"entry must be an object with dtype, shape and data_offsets", _tensor(["U8", [0], [0, 0]])),
    Rule("entry.keys", "Each entry has exactly `dtype`, `shape` and `data_offsets`.", _E,
         r"entry must have exactly dtype, shape and data_offsets",
         _tensor({"dtype": "U8", "shape": [0], "offsets": [0, 0]})),
    Rule("entry.name", "Tensor names are non-empty, without NUL.", _E,
         r"empty name|contains a NUL character|not valid Unicode",
         _one_file({"": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}, b"")),
    Rule("dtype.unknown", "The dtype is one of the 22 safetensors codes, case-sensitive.", _E,
         r"unknown dtype", _tensor({"dtype": "bf16", "shape": [0], "data_offsets": [0, 0]})),
    Rule("dtype.no_torch", "The dtype code has a torch dtype (the `F6` codes have none).", _E,
         r"torch has no dtype for it",
         _tensor({"dtype": "F6_E2M3", "shape": [0], "data_offsets": [0, 0]})),
    Rule("entry.not_ints", "`shape` and `data_offsets` hold non-negative integers (no bools/floats).", _E,
         r"must be a list of non-negative integers|must hold non-negative 64-bit integers",
         _tensor({"dtype": "U8", "shape": [True], "data_offsets": [0, 1]})),
    Rule("offsets.not_pair", "`data_offsets` has exactly two numbers.", _E,
         r"data_offsets must be \[begin, end\]",
         _tensor({"dtype": "U8", "shape": [0], "data_offsets": [0, 0, 0]})),
    Rule("size.overflow", "Elements x bits fits 64-bit arithmetic.", _E,
         r"overflows 64-bit size arithmetic",
         _tensor({"dtype": "F32", "shape": [2**32, 2**30], "data_offsets": [0, 0]})),
    Rule("size.torch_dimension", "Every dimension fits torch's signed 64-bit sizes.", _E,
         r"has a dimension of 2\*\*63 or more",
         _tensor({"dtype": "U8", "shape": [2**63, 0], "data_offsets": [0, 0]})),
    Rule("size.partial_byte", "A tensor is a whole number of bytes.", _E,
         r"not a whole number of bytes",
         _tensor({"dtype": "F4", "shape": [3], "data_offsets": [0, 2]})),
    Rule("f4.odd_last_dim", "`F4` tensors have an even last dimension (torch packs pairs).", _E,
         r"needs an even last dimension",
         _tensor({"dtype": "F4", "shape": [2, 1], "data_offsets": [0, 1]})),
    Rule("offsets.span", "end - begin of `data_offsets` = elements x bits / 8.", _E,
         r"span \d+ bytes, but shape", _one_file({"w": {**_ENTRY, "shape": [3]}})),
    Rule("offsets.not_contiguous", "Data is tiled from 0: no holes, overlaps or shared ranges.", _E,
         r"tensors must tile the data buffer contiguously",
         _one_file({"w": _ENTRY, "v": _ENTRY})),
    Rule("file.size_mismatch", "Last end + 8 + header length = file size.", _E,
         r"header and tensors describe \d+ bytes but the file has",
         _one_file({"w": _ENTRY}, b"\0\0\0")),
    Rule("file.missing", "Every file of the checkpoint exists.", _NF,
         r"no such file \(or a broken symlink\)", _broken_symlink),
    Rule("file.not_regular", "Every file of the checkpoint, and every file the index names, "
         "is a regular file (never a FIFO, device or directory; opened without blocking).", _E,
         r"not a regular file", _not_regular),
    Rule("file.outside_checkpoint", "Every file read is inside the checkpoint directory: no "
         "path a checksum file lists leads out of it through `..` or a symlinked folder.", _E,
         r"outside the checkpoint directory", _outside_folder),
    Rule("dir.not_found", "The checkpoint path exists.", _NF,
         r"no such file or directory", describe),
    Rule("dir.not_directory", "The checkpoint is a directory or a `.safetensors` file.", _E,
         r"not a directory or a regular file", _fifo),
    Rule("dir.unfinished", "A folder a save or a consolidation has not finished (a save's "
         "hidden temporary folder `.<name>.hyperckpt-save-<hex>/`, or consolidate's output, "
         "while their marker is in it: still running, or killed) is refused by every reader "
         "and by verify, also when one of its files is named by its path: its files may be "
         "partly written.", _E, r"has not finished", _torn_save),
    Rule("dir.empty", "A directory holds a checkpoint (hints at a `sharded/` folder).", _NF,
         r"this is not a checkpoint directory", lambda root: describe(write_files(root, {}))),
    Rule("dir.torch_dcp", "A directory torch's `dcp.save` wrote (`.metadata`, `*.distcp`) is "
         "named as such, with the torch call that reads it.", _NF,
         r"a torch distributed checkpoint \(DCP\).*FileSystemReader", _torch_dcp),
    Rule("dir.diffusers_pipeline", "A diffusers pipeline's root (`model_index.json`) names the "
         "subfolders that hold checkpoints.", _NF,
         r"the root of a diffusers pipeline .* point at one of them", _diffusers_pipeline),
    Rule("dir.meta_consolidated", "Meta's original layout (`consolidated.00.pth`, `params.json`) "
         "is named as such, with a conversion that reads it.", _NF,
         r"Meta's original release layout .* convert_llama_weights_to_hf",
         lambda root: describe(write_files(root, {"consolidated.00.pth": b"PK",
                                                  "params.json": b"{}"}))),
    Rule("dir.pickled", "A directory of pickled torch weights (`pytorch_model.bin`) is named "
         "as such, with how to convert it.", _NF,
         r"it holds pytorch_model.bin: pickled torch weights .* convert them to safetensors",
         lambda root: describe(write_files(root, {"pytorch_model.bin": b"PK"}))),
    Rule("dir.ambiguous", "A directory holds one candidate checkpoint: one "
         "`<prefix>.safetensors.index.json`, or one of `model.safetensors`, "
         "`diffusion_pytorch_model.safetensors`, `adapter_model.safetensors`.", _E,
         r"checkpoints are here, .*which one to read is ambiguous",
         _hf({"model.safetensors": encode_file({}), "diffusion_pytorch_model.safetensors": encode_file({})})),
    Rule("dir.unknown_kind", "Several safetensors files need an index, a single file's name "
         "or DCP_SHARDING_INFO to say which belong.", _E,
         r"so which files form the checkpoint is unknown",
         lambda root: describe(write_files(root, {"a.safetensors": encode_file({}),
                                                  "b.safetensors": encode_file({})}))),
    Rule("hf.no_checkpoint", "A Hugging Face directory has an index, a single file's name or "
         "only one `*.safetensors` file (one shard of several, `model-00001-of-00003.safetensors`, "
         "is not enough; `model-00001-of-00001.safetensors` is).", _NF,
         r"no \*\.safetensors\.index\.json and no single .* is there",
         _hf({"a.safetensors": encode_file({}), "b.safetensors": encode_file({})})),
    Rule("hf.single_beside_index", "`model.safetensors` beside an index that does not name it "
         "holds the same tensors (transformers reads it, hyperckpt the index).", _E,
         r"are both here, the index does not name model.safetensors, and they disagree",
         _hf({"m-1.safetensors": encode_file({"a": _ENTRY}, b"\0\0"),
              "model.safetensors": encode_file({"b": _ENTRY}, b"\0\0")},
             {"weight_map": {"a": "m-1.safetensors"}})),
    Rule("index.too_big", "The index is at most 100,000,000 bytes.", _E,
         r"more than any real index", _big_index),
    Rule("index.not_regular", "The index is a regular file.", _E,
         r"not a regular file; the index", _not_regular_index),
    Rule("index.not_utf8", "The index is UTF-8.", _E,
         r"model.safetensors.index.json: not valid UTF-8", _two_files(b"\xff")),
    Rule("index.not_json", "The index is JSON without duplicate keys.", _E,
         r"index (is not valid JSON|has the key .* twice|JSON is nested)", _two_files(b"{")),
    Rule("index.too_many_tokens", "A large index holds no more strings, arrays or objects "
         "than a real index (bounds parsing memory).", _E,
         r"index of \d+ characters holds \d+ .*far more",
         _two_files(('{"weight_map": {"a": "m-1.safetensors"}, "x": ' + _ARRAY_BOMB + "}").encode())),
    Rule("index.no_weight_map", "The index is an object with a `weight_map`.", _E,
         r'must be a JSON object with a "weight_map"', _two_files({"metadata": {}})),
    Rule("index.weight_map_not_object", "`weight_map` is a non-empty object.", _E,
         r'"weight_map" must be a non-empty object', _two_files({"weight_map": {}})),
    Rule("index.file_not_string", "`weight_map` values are file names.", _E,
         r"must be a file name string", _two_files({"weight_map": {"a": 1}})),
    Rule("index.not_plain_name", "Index file names are plain names inside the directory.", _E,
         r"not a plain file name", _two_files({"weight_map": {"a": "../m-1.safetensors"}})),
    Rule("index.file_missing", "Every file the index names exists.", _NF,
         r"named by model.safetensors.index.json for tensor",
         _two_files({"weight_map": {"a": "m-1.safetensors", "c": "m-3.safetensors"}})),
    Rule("index.tensor_not_in_file", "Each tensor is in the file the index names.", _E,
         r"places tensor .* but .* lacks it",
         _two_files({"weight_map": {"a": "m-2.safetensors", "b": "m-2.safetensors"}})),
    Rule("index.omits_tensor", "The index lists every tensor the files hold.", _E,
         r"which model.safetensors.index.json omits",
         _hf({"m-1.safetensors": encode_file({"a": _ENTRY, "x": {**_ENTRY, "data_offsets": [2, 4]}}, b"\0" * 4)},
             {"weight_map": {"a": "m-1.safetensors"}})),
    Rule("hf.tensor_in_two_files", "A Hugging Face checkpoint holds each tensor once.", _E,
         r"is in two files", _two_files(_MAP, {"a": _ENTRY})),
    Rule("hf.sharded_piece", "`DCP_SHARDING_INFO` offsets in a Hugging Face file are all zero.", _E,
         r"this is a torch sharded directory: use TorchShardedSafetensorsReader",
         _hf({"model.safetensors": _shard({"w": ("U8", [2], [2])})})),
    Rule("sharded.index_present", "A torch sharded directory has no index.", _E,
         r"so it is a Hugging Face checkpoint, not a torch sharded directory; use "
         r"HuggingFaceStorageReader", _sharded({INDEX_NAME: b"{}", _SHARD_A: _shard({})})),
    Rule("sharded.no_files", "A torch sharded directory has `*.safetensors` files.", _NF,
         r"no \*.safetensors files, so no torch sharded checkpoint is here", _sharded({})),
    Rule("sharded.no_info", "Every shard file carries `DCP_SHARDING_INFO`.", _E,
         r"no DCP_SHARDING_INFO in __metadata__",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}), "extra.safetensors": encode_file({})})),
    Rule("sharded.info_not_json", "`DCP_SHARDING_INFO` is JSON without duplicate keys.", _E,
         r"DCP_SHARDING_INFO (is not valid JSON|has the key .* twice|JSON is nested)",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}, info=_INFO[:-1])})),
    Rule("sharded.info_too_many_tokens", "A large `DCP_SHARDING_INFO` string holds no more "
         "strings, arrays or objects than real sharding information (bounds parsing memory).", _E,
         r"DCP_SHARDING_INFO of \d+ characters holds \d+ .*far more",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}, info=_ARRAY_BOMB)})),
    Rule("sharded.info_not_object", "`DCP_SHARDING_INFO` is a JSON object.", _E,
         r"DCP_SHARDING_INFO must be a JSON object",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}, info="[]")})),
    Rule("sharded.info_missing_tensor", "`DCP_SHARDING_INFO` describes every tensor of the file.", _E,
         r"has no entry in DCP_SHARDING_INFO",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}, info="{}")})),
    Rule("sharded.info_extra_tensor", "`DCP_SHARDING_INFO` describes only tensors of the file.", _E,
         r"describes tensor .*, which the file does not hold",
         _sharded({_SHARD_A: _shard({}, info=_INFO)})),
    Rule("sharded.info_bad_offsets", "`saved_offsets` holds one non-negative integer per dimension.", _E,
         r'must be \{"saved_offsets": \[\.\.\.\]\}',
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0, 0])})})),
    Rule("sharded.dtype_mismatch", "All pieces of a tensor share one dtype.", _E,
         r"all pieces of a tensor share one dtype",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}), _SHARD_B: _shard({"w": ("F32", [2], [2])})})),
    Rule("sharded.ndim_mismatch", "All pieces of a tensor share one number of dimensions.", _E,
         r"share one rank",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}), _SHARD_B: _shard({"w": ("U8", [2, 1], [2, 0])})})),
    Rule("sharded.torch_dimension", "Pieces reach no dimension of 2**63 or more.", _E,
         r"a dimension of 2\*\*63 or more",
         _sharded({_SHARD_A: _shard({"w": ("U8", [0, 2**62], [0, 2**62])})})),
    Rule("tiling.duplicate", "No two pieces of a tensor start at the same offsets.", _E,
         r"both hold a piece at offsets",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2], [0])}), _SHARD_B: _shard({"w": ("U8", [2], [0])})})),
    Rule("tiling.overlap", "Pieces of a tensor are pairwise disjoint.", _E,
         r"overlap in \[|pieces in .* overlap \(",
         _sharded({_SHARD_A: _shard({"w": ("U8", [3], [0])}), _SHARD_B: _shard({"w": ("U8", [2], [2])})})),
    Rule("tiling.gap", "Pieces of a tensor cover all of it (checked box by box, not by volume).", _E,
         r"a shard file is probably missing",
         _sharded({_SHARD_A: _shard({"w": ("U8", [2, 2], [0, 0])}), _SHARD_D: _shard({"w": ("U8", [2, 2], [2, 2])})})),
    Rule("tiling.too_complex", "A tensor's pieces are cut along few enough dimensions to "
         "check (pieces x 2**dimensions cut at most 4,194,304 beyond 6 dimensions).", _E,
         r"no real tensor is sharded so", _too_complex),
    Rule("reader.f4_mid_byte", "An `F4` piece starts at an even column (torch packs `F4` pairs).", _E,
         r"starts mid-byte", _f4_mid_byte),
    Rule("mapping.source", "Every source a mapping's fused tensor names is in the checkpoint.", _E,
         r"needs source .* which is not in the checkpoint",
         _mapped({f"{_X}.0.gate_proj.weight": _expert([2, 3])}, "qwen3-moe")),
    Rule("mapping.partner", "A checkpoint tensor matching a fused tensor's source comes with its "
         "partners.", _E, r"but its partner .* is not in the checkpoint",
         _mapped({f"{_X}.0.up_proj.weight": _expert([2, 3])}, "qwen3-moe")),
    Rule("mapping.stack_gap", "Stacked sources are numbered 0..K-1 without a gap (an index "
         "with more digits than the checkpoint has tensors is refused before it is read as a "
         "number).", _E, r"(index \d+ is|indices \d+-\d+ are) missing|so there is a gap",
         _mapped({f"{_X}.{e}.down_proj.weight": _expert([3, 2]) for e in (0, 2)}, "qwen3-moe")),
    Rule("mapping.stack_index", "A stacked source's index is a plain decimal number (`0`, `1`, "
         "... in ASCII digits; not `01`, `-1` or `+2`).", _E, r"is not a plain decimal index",
         _mapped({f"{_X}.{e}.down_proj.weight": _expert([3, 2]) for e in ("0", "01")}, "qwen3-moe")),
    Rule("mapping.function", "A rename function returns a non-empty string or `None` for every "
         "tensor, and raises nothing.", _E, r"raised \w+ .* on tensor|a rename function returns",
         _mapped({"w": _expert([2])}, _renamed_from_a_table)),
    Rule("mapping.not_invertible", "A save with `mapping=` runs it backwards: every rule has "
         "an inverse (no rename function, no `Replace` to the empty string; the sizes a "
         "concatenation is cut into are `mapping.split_*`).", _E,
         r"cannot be run backwards|does not start with it|where it stood|sits at two places|gives checkpoint name|from several names|no "
         r"dimension", _saved_through_a_function),
    Rule("mapping.split_unknown", "A save with `mapping=` knows the sizes it cuts a concatenated "
         "tensor into: `Fuse(..., equal=True)`, or `split=` sizes, fixed or read from a tensor of "
         "the state dict (`qkv-proj` reads `q`'s width from `o_proj.weight`).", _E,
         r"sizes along that dimension are not in the state dict|which the state dict does not hold",
         _saved_qkv({"a.qkv_proj.weight": (6, 2)})),
    Rule("mapping.split_mismatch", "The sizes a save cuts a concatenated tensor into add up to "
         "its width (equal shares divide it exactly).", _E, r"which does not cut \d+ exactly|which "
         r"has shape", _saved_qkv({"a.qkv_proj.weight": (6, 2), "a.o_proj.weight": (2, 5)})),
    Rule("mapping.dtype", "The sources of a fused tensor share one dtype.", _E,
         r"is \w+ but .* is \w+; a fused tensor has one dtype",
         _mapped({f"{_X}.{e}.down_proj.weight": _expert([3, 2], ("BF16", "F16")[e]) for e in (0, 1)},
                 "qwen3-moe")),
    Rule("mapping.shape", "Stacked sources share one shape; concatenated ones differ only along the "
         "concatenation dimension.", _E, r"has shape \[.*\] but .* has \[",
         _mapped({f"{_X}.{e}.down_proj.weight": _expert([3, 2 + e]) for e in (0, 1)}, "qwen3-moe")),
    Rule("mapping.collision", "No two tensors end up with one name after a mapping.", _E,
         r"two tensors end up named",
         _mapped({"a": _expert([2]), "model.a": _expert([2])}, "strip-model-prefix")),
    Rule("load.shape_mismatch", "A destination has the checkpoint tensor's shape; a larger one "
         "means a shard file is probably missing (`hyperckpt.load`, `hyperckpt.SafetensorsLoadPlanner`).", _E,
         r"a shard file is probably missing \(the one holding", _shape_larger),
    Rule("checksums.not_regular", "A checksum file is a regular file (never a FIFO or device; "
         "opened without blocking).", _E, r"not a regular file", _checksums_fifo),
    Rule("checksums.too_big", "A checksum file is at most 100,000,000 bytes (refused from its "
         "size).", _E, r"more than any checksum file", _checksums_big),
    Rule("path.unsupported_url", "A path that looks like a URL (`s3://`, `S3://`, the `s3:/` a "
         "`pathlib.Path` makes of one, `gs://`, `az://`, `file://`, `hf://`, ...) names a store "
         "served for what is asked: reading takes local directories and `s3://bucket/prefix`, "
         "writing (save, the writer, consolidate's output, the sample) local directories only. "
         "Anything else is refused before a byte is read or written, never taken as a local "
         "folder named `s3:`.", _E, r"looks like a URL of scheme", _url_save),
    Rule("path.empty", "A path is never the empty string, which pathlib reads as the "
         "working directory (an unset variable): `'.'` says so.", _E,
         r"the empty string is not a path", _empty_save),
    Rule("output.exists", "A file hyperckpt writes is created where nothing is, never through "
         "a link.", _E, r"files are only created where nothing is", _planted_link),
    Rule("output.not_empty", "A writer's destination (save's path, the writer's, "
         "consolidate's output; a symlink is followed and judged where it leads) is new or "
         "empty, unless `overwrite=True` (which replaces the checkpoint's `*.safetensors` "
         "and index there and keeps every other file) or it holds the same writer's marker "
         "(an interrupted write, finished now).", _E, r"not empty \(holds .*overwrite=True",
         _existing_save),
    Rule("output.not_directory", "A writer's destination is a directory or nothing: a "
         "regular file, a FIFO, a symlink to nothing or a symlink loop is refused, even with "
         "`overwrite=True` (it is not a checkpoint's files to replace).", _E,
         r"a checkpoint is written as a directory|files are never written through a link",
         _file_as_output),
    Rule("output.not_regular", "What a writer replaces in its output is a regular file or "
         "a link (replaced as a link): a directory or FIFO under a safetensors or index name, "
         "or a link as a marker, is refused.", _E,
         r"it was not left by a save or a consolidation", _marker_link),
    Rule("output.holds_input", "Consolidate never removes an input: an output file that is "
         "an input (a link's target, a hard link) is refused.", _E,
         r"replacing it would lose input", _input_in_output),
    Rule("output.header_too_long", "Every file consolidate writes has a header within the "
         "format's limit (files are split by header size; a `like` assignment is refused).",
         _E, r"its header would be \d+ bytes, over the format's limit",
         lambda root: _long_names(root, 2, 50_000_000, like=True)),
    Rule("output.index_too_big", "The index consolidate writes is within the index limit.",
         _E, r"over the \d+-byte limit of an index",
         lambda root: _long_names(root, 3, 40_000_000, like=False)),
    Rule("load.missing_keys", "The checkpoint holds every state-dict key not allowed to be "
         "missing; an `allow_missing` name that is no key is named with the key it likely meant "
         "(`hyperckpt.load`).", _E, r"the checkpoint lacks \d+ tensor\(s\) the state dict has",
         _missing_key),
    Rule("load.tied_differ", "Tied weights (one memory in the model) that the checkpoint stores "
         "each hold equal values, unless `tied_winners` names the one to load "
         "(`hyperckpt.load`, on every rank).", _E,
         r"are tied weights, one memory in the model, but the checkpoint stores different values",
         _tied_differ),
)  # fmt: skip
RULES: tuple[Rule, ...] = (
    *_READ_RULES,
    *(Rule(rule_id, text, _E, pattern, trigger) for rule_id, text, pattern, trigger in SAVE_RULES),
)


def provoke(rule: Rule) -> CheckpointError:
    """Break ``rule`` in a fresh temporary directory and return the error raised.

    Paths in the message and attributes are shown relative to that directory (the
    checkpoint itself is ``ckpt``).

    Raises:
        AssertionError: The trigger raised nothing, or not a :class:`CheckpointError`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rule.trigger(Path(tmp) / "ckpt")
        except CheckpointError as err:
            prefix = tmp + os.sep
            text = str(err).replace(prefix, "")
            path = None if err.path is None else err.path.replace(prefix, "")
            return type(err)(text, path=path, tensor=err.tensor, rule=err.rule)
    raise AssertionError(f"{rule.id}: the trigger raised no CheckpointError")


_INTRO = """\
# The rules hyperckpt enforces

Every rule below is checked from the safetensors headers and the directory listing alone
(a file that cannot be safetensors is named from its first KiB: a pickle, a Git LFS
pointer), before any tensor data is read; `describe(path)` runs them all and raises the
typed error, while inside `dcp.load` torch keeps only the message text, so each message
stands alone.
`CheckpointNotFoundError` is a `CheckpointError` and a `FileNotFoundError`.  The error's
`path` attribute names the file (relative to the checkpoint) and `tensor` the tensor.

The id in the first column is on the error as `err.rule` (and in each problem of `hyperckpt
validate --json` as `rule`): tools and tests match the id, which stays the same when a
message is reworded; the message is for people.  An error one rank raises and the other
ranks re-raise keeps its id on every rank.

The faults `hyperckpt.testing` builds (`file_faults`, `huggingface_faults`,
`sharded_faults`) name the id of the rule they break, so a property test can check that the
matching error is raised.  Each example message is real: this page is generated by
`python tests/rule_catalogue.py docs/rules.md` from `tests/rule_catalogue.py`, and
`tests/unit/package/test_rules_doc.py` fails when it is stale.  The checkpoint directory in the
examples is `ckpt`.  The `mapping.*` rules are checked, from the headers too, when a mapping
is applied (`mapping=` of the readers and `hyperckpt.load`, `Mapping.apply`, `hyperckpt
inspect --mapping`).  The `save.*` rules are checked by `hyperckpt.save` and
`hyperckpt.HuggingFaceStorageWriter` before a byte is written (the audit and a lost rank
after writing, before anything is published); raised on every rank.

What the data holds (checksums, NaN and infinities) and which dtype conversions a load may
make are checked by `hyperckpt validate --data` and `dtype_policy`: see
[data checks](data-checks.md).

The last rules guard what hyperckpt reads and writes besides a checkpoint's headers: the
checksum file `validate --data --checksums` reads and the paths it lists
(`file.outside_checkpoint`, `checksums.*`), and every file it creates (`output.*`: created
exclusively under a temporary name, never through a link, renamed when complete; nothing
written breaks a rule above, and no input is ever removed).

Two guarantees hold for every rule: every path the checkpoint controls is opened one way
(non-blocking, regular files only, sizes checked before any read), and every JSON text it
holds (headers, the index, `DCP_SHARDING_INFO`) is counted in linear time before it is
parsed, so a refusal takes time linear in the input and memory within a small multiple of
it (at most 6.5x for the worst hostile class measured; see [hostile.md](hostile.md)).
Messages are one printable line: names from the checkpoint are escaped.

| id | rule | error | example message |
|---|---|---|---|
"""


def render_rules_page() -> str:
    """The Markdown text of ``docs/rules.md``: every rule with a real example message."""
    rows = []
    for rule in RULES:
        err = provoke(rule)
        cells = [f"`{rule.id}`", rule.summary, f"`{type(err).__name__}`", f"`{err}`"]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return _INTRO + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the rules page to the path given (default ``docs/rules.md``)."""
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0] if args else "docs/rules.md")
    target.write_text(render_rules_page(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

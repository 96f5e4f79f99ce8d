"""``ReadOptions``: validated once, held by the reader, one object from ``load`` to the threads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import poison_, write_hf_checkpoint

import hyperckpt
from hyperckpt import HuggingFaceStorageReader, Mapping, ReadOptions, TorchShardedSafetensorsReader
from hyperckpt._read.engine import ReadEngine


def test_bad_values_are_refused_when_the_options_are_made() -> None:
    cases = [
        ({"thread_count": 0}, "thread_count must be at least 1, got 0"),
        ({"staging_bytes": 0}, "staging_bytes must be positive, got 0"),
        ({"exchange": "sideways"}, "exchange must be one of auto, off, replicated, striped"),
        ({"dtype_policy": "loose"}, "dtype_policy must be one of 'convert', 'exact'"),
        ({"header_reads": "twice"}, "header_reads must be one of auto, once"),
        ({"mapping": "no-such-preset"}, "unknown mapping 'no-such-preset'"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            ReadOptions(**fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="thread_count must be at least 1"):
        dataclasses.replace(ReadOptions(), thread_count=-1)


def test_the_options_are_frozen_and_a_mapping_is_held_as_a_mapping() -> None:
    options = ReadOptions(mapping="qwen3-moe")  # type: ignore[arg-type]
    assert options.mapping == Mapping.preset("qwen3-moe")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.thread_count = 2  # type: ignore[misc]


@pytest.mark.parametrize("reader_class", [HuggingFaceStorageReader, TorchShardedSafetensorsReader])
def test_keywords_and_options_make_the_same_reader(
    tmp_path: Path, reader_class: type[HuggingFaceStorageReader]
) -> None:
    keywords = reader_class(
        tmp_path, thread_count=2, staging_bytes=4096, exchange="off", mapping="qwen3-moe"
    )
    typed = ReadOptions(
        thread_count=2, staging_bytes=4096, exchange="off", mapping=Mapping.preset("qwen3-moe")
    )
    assert keywords.options == typed
    assert reader_class(tmp_path, options=typed).options is typed
    assert reader_class(tmp_path).options == ReadOptions()
    assert (keywords.thread_count, keywords.staging_bytes, keywords.exchange) == (2, 4096, "off")


def test_options_and_keywords_together_are_refused_naming_the_keywords(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="thread_count, exchange given as well as options="):
        HuggingFaceStorageReader(
            tmp_path, options=ReadOptions(), thread_count=2, exchange="striped"
        )


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[ReadEngine]:
    """The read engines the readers make, in order."""
    made: list[ReadEngine] = []

    class Recording(ReadEngine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr("hyperckpt._load.readers.ReadEngine", Recording)
    return made


def test_the_reader_hands_its_options_object_to_the_engine(
    tmp_path: Path, engines: list[ReadEngine]
) -> None:
    tensors = {"w": torch.randn(8, 4)}
    write_hf_checkpoint(tmp_path, tensors)
    reader = HuggingFaceStorageReader(tmp_path, options=ReadOptions(thread_count=3))
    out = {"w": poison_(torch.empty(8, 4))}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], tensors["w"])
    [engine] = engines
    assert engine.options is reader.options
    assert engine.threads == 3
    assert reader.last_stats is not None
    assert reader.last_stats.threads == 3


def test_load_passes_its_keywords_and_reader_options_as_one_object(
    tmp_path: Path, engines: list[ReadEngine]
) -> None:
    tensors = {"w": torch.randn(8, 4)}
    write_hf_checkpoint(tmp_path, tensors)
    out = {"w": poison_(torch.empty(8, 4, dtype=torch.float64))}
    hyperckpt.load(
        out, tmp_path, thread_count=2, exchange="off", reader_options={"staging_bytes": 64}
    )
    assert torch.equal(out["w"], tensors["w"].double())
    [engine] = engines
    assert isinstance(engine.options, ReadOptions)
    assert dataclasses.replace(engine.options, progress=None) == ReadOptions(
        thread_count=2, staging_bytes=64, exchange="off"
    )

"""``ReadOptions``: validated once, held by the reader, one object from ``load`` to the threads."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import poison_, write_hf_checkpoint

import hyperckpt
from hyperckpt import HuggingFaceStorageReader, Mapping, ReadOptions, TorchShardedSafetensorsReader
from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._read.engine import ReadEngine


def test_bad_values_are_refused_when_the_options_are_made() -> None:
    cases = [
        ({"thread_count": 0}, "thread_count must be an int from 1 to 1024, got 0"),
        (
            {"staging_bytes": 0},
            "staging_bytes must be an int from 64 to 2\\*\\*62 \\(bytes\\), got 0",
        ),
        ({"exchange": "sideways"}, "exchange must be one of auto, off, replicated, striped"),
        ({"dtype_policy": "loose"}, "dtype_policy must be one of 'convert', 'exact'"),
        ({"header_reads": "twice"}, "header_reads must be one of auto, once"),
        ({"mapping": "no-such-preset"}, "unknown mapping 'no-such-preset'"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            ReadOptions(**fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="thread_count must be an int from 1"):
        dataclasses.replace(ReadOptions(), thread_count=-1)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"thread_count": math.nan}, TypeError, "thread_count must be an int .* got nan"),
        ({"thread_count": math.inf}, TypeError, "thread_count must be an int .* got inf"),
        ({"thread_count": 2.0}, TypeError, "thread_count must be an int .* of type float"),
        ({"thread_count": True}, TypeError, "thread_count must be an int .* got True"),
        ({"thread_count": 10**30}, ValueError, "thread_count must be an int from 1 to 1024"),
        ({"staging_bytes": math.nan}, TypeError, "staging_bytes must be an int"),
        ({"staging_bytes": "64"}, TypeError, "staging_bytes must be an int .* of type str"),
        (
            {"cost_model": "fast"},
            TypeError,
            "cost_model must be a hyperckpt.types.CostModel or None",
        ),
        ({"progress": 3}, TypeError, "progress must be a function \\(or None\\), got 3"),
        ({"process_group": "world"}, TypeError, "process_group must be a torch.distributed"),
        ({"exchange": ["off"]}, ValueError, "exchange must be one of"),
        ({"mapping": 3}, TypeError, "mapping must be a hyperckpt.Mapping"),
    ],
)
def test_hostile_values_are_refused_by_name_when_made(
    fields: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ReadOptions(**fields)  # type: ignore[arg-type]


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


def test_keywords_set_fields_of_options_and_an_option_given_twice_is_refused(
    tmp_path: Path,
) -> None:
    base = ReadOptions(staging_bytes=4096)
    reader = HuggingFaceStorageReader(tmp_path, options=base, thread_count=2, exchange="off")
    assert reader.options == ReadOptions(staging_bytes=4096, thread_count=2, exchange="off")
    # Twice, even with the same value or the default's: there is no silent winner.
    for keywords in ({"staging_bytes": 4096}, {"staging_bytes": DEFAULT_STAGING_BYTES}):
        with pytest.raises(
            ValueError,
            match=r"an option is given two ways: staging_bytes as options.staging_bytes and as "
            r"staging_bytes=; give each option once",
        ):
            HuggingFaceStorageReader(tmp_path, options=base, **keywords)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"thread_count as options.thread_count and as thread_count=; exchange"
    ):
        HuggingFaceStorageReader(
            tmp_path,
            options=ReadOptions(thread_count=4, exchange="striped"),
            thread_count=2,
            exchange="striped",
        )
    with pytest.raises(
        TypeError, match=r"options must be a hyperckpt.ReadOptions or None, got dict"
    ):
        HuggingFaceStorageReader(tmp_path, options={"thread_count": 2})  # type: ignore[arg-type]


def test_load_refuses_an_option_given_twice_before_reading(tmp_path: Path) -> None:
    options = ReadOptions(thread_count=4)
    with pytest.raises(
        ValueError, match=r"thread_count as options.thread_count and as thread_count="
    ):
        hyperckpt.load({}, tmp_path / "nowhere", options=options, thread_count=2)


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


def test_load_passes_its_keywords_and_options_as_one_object(
    tmp_path: Path, engines: list[ReadEngine]
) -> None:
    tensors = {"w": torch.randn(8, 4)}
    write_hf_checkpoint(tmp_path, tensors)
    out = {"w": poison_(torch.empty(8, 4, dtype=torch.float64))}
    hyperckpt.load(
        out, tmp_path, thread_count=2, exchange="off", options=ReadOptions(staging_bytes=64)
    )
    assert torch.equal(out["w"], tensors["w"].double())
    [engine] = engines
    assert isinstance(engine.options, ReadOptions)
    assert dataclasses.replace(engine.options, progress=None) == ReadOptions(
        thread_count=2, staging_bytes=64, exchange="off"
    )


def test_load_applies_the_mapping_once_and_hands_the_reader_the_mapped_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_hf_checkpoint(tmp_path, {"model.w": torch.randn(4, 2)})
    applied: list[Mapping] = []
    apply = Mapping.apply

    def counting(
        self: Mapping, layout: hyperckpt.types.CheckpointLayout
    ) -> hyperckpt.mapping.MappedLayout:
        applied.append(self)
        return apply(self, layout)

    monkeypatch.setattr(Mapping, "apply", counting)
    out = {"w": poison_(torch.empty(4, 2))}
    hyperckpt.load(out, tmp_path, mapping="strip-model-prefix")
    assert applied == [Mapping.preset("strip-model-prefix")]


def test_a_reader_given_a_layout_reads_no_header_for_its_first_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {"w": torch.randn(4, 2)}
    write_hf_checkpoint(tmp_path, tensors)
    mapped = Mapping(()).apply(hyperckpt.describe(tmp_path))
    reader = HuggingFaceStorageReader(tmp_path, layout=mapped)
    reads: list[object] = []
    monkeypatch.setattr(
        "hyperckpt._load.readers.reader_layout", lambda *args, **kwargs: reads.append(args)
    )
    out = {"w": poison_(torch.empty(4, 2))}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], tensors["w"])
    assert reads == []
    assert reader.layout is mapped.layout
    with pytest.raises(TypeError, match=r"layout must be a hyperckpt.mapping.MappedLayout or None"):
        HuggingFaceStorageReader(tmp_path, layout=mapped.layout)  # type: ignore[arg-type]


def test_the_largest_staging_budget_is_a_ceiling_not_an_allocation(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(64, 8)}
    write_hf_checkpoint(tmp_path, tensors)
    out = {"w": poison_(torch.empty(64, 8, dtype=torch.float64))}  # staged: converted
    reader = HuggingFaceStorageReader(tmp_path, staging_bytes=2**62, thread_count=1024)
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], tensors["w"].double())
    assert reader.last_stats is not None
    assert reader.last_stats.staging_peak <= 64 * 8 * 4 + 2**20

"""NaN, Inf and zero counts on raw bits, format by format, against torch's own reading."""

from __future__ import annotations

import struct

import pytest
import torch

from hyperckpt._verify.scan import FLOAT_CODES, ScanCounts, Scanner

# Every 8-bit float format torch can convert, with the code safetensors uses for it.
TORCH_8BIT = {
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def scan(code: str, data: bytes, *, piece: int | None = None) -> ScanCounts:
    scanner = Scanner(code)
    tensor = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    step = piece or max(1, len(data))
    for start in range(0, len(data), step):
        scanner.feed(tensor[start : start + step])
    return scanner.finish()


def torch_counts(values: torch.Tensor) -> tuple[int, int, int]:
    wide = values.to(torch.float64)
    return (
        int(torch.isnan(wide).sum()),
        int(torch.isposinf(wide).sum()),
        int(torch.isneginf(wide).sum()),
    )


@pytest.mark.parametrize("code", sorted(TORCH_8BIT))
def test_every_byte_of_each_8_bit_float_counts_as_torch_reads_it(code: str) -> None:
    every = bytes(range(256))
    counts = scan(code, every)
    expected = torch_counts(
        torch.frombuffer(bytearray(every), dtype=torch.uint8).view(TORCH_8BIT[code])
    )
    assert (counts.nan, counts.posinf, counts.neginf) == expected


@pytest.mark.parametrize(("code", "dtype"), [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_every_16_bit_pattern_counts_as_torch_reads_it(code: str, dtype: torch.dtype) -> None:
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    counts = scan(code, every.numpy().tobytes())
    assert (counts.nan, counts.posinf, counts.neginf) == torch_counts(every.view(dtype))


@pytest.mark.parametrize(
    ("code", "dtype", "width"),
    [
        ("F32", torch.float32, 4),
        ("F64", torch.float64, 8),
        ("C64", torch.float32, 4),
    ],
)
def test_wide_floats_count_special_patterns_and_random_bits_as_torch_does(
    code: str, dtype: torch.dtype, width: int
) -> None:
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (4096 * width,), dtype=torch.uint8, generator=generator)
    # Random bits rarely hit an exponent of all ones: add every special value by hand.
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0]
    special = torch.tensor(specials, dtype=dtype).view(torch.uint8)
    signalling = b"\x01\x00\x80\x7f" if width == 4 else b"\x01" + b"\x00" * 5 + b"\xf0\x7f"
    data = noise.numpy().tobytes() + special.numpy().tobytes() + signalling
    counts = scan(code, data)
    reference = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    assert (counts.nan, counts.posinf, counts.neginf) == torch_counts(reference)
    assert counts.nan >= 2
    assert counts.posinf >= 1
    assert counts.neginf >= 1


@pytest.mark.parametrize(
    ("code", "data", "nan", "posinf", "neginf"),
    [
        (
            "F16",
            struct.pack("<8H", 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x8000, 0, 0x7BFF),
            3,
            1,
            1,
        ),
        ("BF16", struct.pack("<6H", 0x7F80, 0xFF80, 0x7FC0, 0xFF81, 0x7F81, 0x7F7F), 3, 1, 1),
        (
            "F32",
            struct.pack("<5I", 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F7FFFFF),
            2,
            1,
            1,
        ),
        (
            "F64",
            struct.pack("<3Q", 0x7FF0_0000_0000_0000, 0xFFF8_0000_0000_0000, 0x7FEF_FFFF_FFFF_FFFF),
            1,
            1,
            0,
        ),
        ("F8_E5M2", bytes([0x7C, 0xFC, 0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF, 0x7B]), 6, 1, 1),
        ("F8_E4M3", bytes([0x7F, 0xFF, 0x7E, 0xFE, 0x78, 0xF8, 0x00, 0x80]), 2, 0, 0),
        ("F8_E4M3FNUZ", bytes([0x80, 0x7F, 0xFF, 0x00, 0x01]), 1, 0, 0),
        ("F8_E5M2FNUZ", bytes([0x80, 0x80, 0x7C, 0xFC, 0x7F, 0xFF]), 2, 0, 0),
        ("F8_E8M0", bytes([0xFF, 0x00, 0x7F, 0xFE]), 1, 0, 0),
        ("F4", bytes([0x77, 0xFF, 0x88, 0x00]), 0, 0, 0),
        ("C64", struct.pack("<4I", 0x7FC00000, 0x3F800000, 0xFF800000, 0x7F800000), 1, 1, 1),
        ("F6_E2M3", bytes([0xFF, 0x3F, 0x00]), 0, 0, 0),
    ],
)
def test_each_format_counts_its_own_nan_and_inf_encodings(
    code: str, data: bytes, nan: int, posinf: int, neginf: int
) -> None:
    counts = scan(code, data)
    assert (counts.nan, counts.posinf, counts.neginf) == (nan, posinf, neginf)
    assert not counts.all_zero


@pytest.mark.parametrize(
    ("code", "zeros"),
    [
        ("F16", struct.pack("<2H", 0x8000, 0)),
        ("BF16", struct.pack("<2H", 0x8000, 0)),
        ("F32", struct.pack("<2I", 0x80000000, 0)),
        ("F64", struct.pack("<2Q", 0x8000_0000_0000_0000, 0)),
        ("F8_E5M2", bytes([0x80, 0x00])),
        ("F8_E4M3", bytes([0x80, 0x00])),
        ("F8_E4M3FNUZ", bytes([0x00, 0x00])),
        ("F4", bytes([0x88, 0x08, 0x80, 0x00])),
        ("C64", struct.pack("<4I", 0x80000000, 0, 0, 0x80000000)),
        ("I32", bytes(8)),
        ("BOOL", bytes(3)),
    ],
)
def test_zeros_of_either_sign_make_an_all_zero_tensor(code: str, zeros: bytes) -> None:
    assert scan(code, zeros).all_zero


def test_fnuz_0x80_is_nan_not_negative_zero_and_e8m0_has_no_zero() -> None:
    assert not scan("F8_E4M3FNUZ", bytes([0x00, 0x80])).all_zero
    assert scan("F8_E4M3FNUZ", bytes([0x00, 0x80])).nan == 1
    assert not scan("F8_E8M0", bytes(4)).all_zero
    assert not scan("I8", bytes([0, 1])).all_zero


def test_an_empty_tensor_is_not_reported_all_zero() -> None:
    assert scan("F32", b"") == ScanCounts(0, 0, 0, False, 0)


@pytest.mark.parametrize("piece", [1, 3, 5, 7])
def test_counts_do_not_depend_on_where_the_bytes_are_cut(piece: int) -> None:
    values = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0] * 7)
    for code, dtype in [("F32", torch.float32), ("BF16", torch.bfloat16), ("F64", torch.float64)]:
        data = values.to(dtype).view(torch.uint8).numpy().tobytes()
        assert scan(code, data, piece=piece) == scan(code, data), (code, piece)


def test_a_piece_at_an_odd_address_is_read_through_an_aligned_copy() -> None:
    data = b"\x00" + struct.pack("<3H", 0x7FC0, 0x3F80, 0xFF80)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    scanner = Scanner("BF16")
    scanner.feed(tensor[1:])
    counts = scanner.finish()
    assert (counts.nan, counts.posinf, counts.neginf) == (1, 0, 1)


def test_every_float_code_of_safetensors_has_a_rule() -> None:
    from hyperckpt._format.header import DTYPES

    floats = {code for code in DTYPES if code.startswith(("F", "BF", "C"))}
    assert floats == set(FLOAT_CODES)


@pytest.mark.parametrize(
    ("code", "dtype"), [("F16", torch.float16), ("BF16", torch.bfloat16), ("F32", torch.float32)]
)
def test_finite_values_whose_sum_overflows_are_not_counted_as_infinite(
    code: str, dtype: torch.dtype
) -> None:
    largest = torch.finfo(dtype).max
    data = torch.full((64,), largest, dtype=dtype).view(torch.uint8).numpy().tobytes()
    assert not torch.isfinite(torch.full((64,), largest, dtype=dtype).sum())
    counts = scan(code, data)
    assert (counts.nan, counts.posinf, counts.neginf) == (0, 0, 0)

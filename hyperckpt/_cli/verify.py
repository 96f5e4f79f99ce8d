"""``hyperckpt validate --data``: the data pass of the command line, its table and JSON."""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any, Final

from hyperckpt._format.preview import preview
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._read.progress import format_bytes
from hyperckpt._read.tracker import ProgressLine
from hyperckpt._verify.checksums import write_checksums
from hyperckpt._verify.run import VerifyReport, verify_layout
from hyperckpt.errors import printable

__all__ = [
    "add_arguments",
    "print_report",
    "report_json",
    "run_data_pass",
    "validate_data",
    "wants_data",
]

_SHOWN: Final = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The data-pass options of ``hyperckpt validate``."""
    group = parser.add_argument_group(
        "data pass",
        "read every byte once: sha256 of each file, NaN/Inf and all-zero counts of every "
        "tensor; exit 1 on a checksum mismatch or NaN/Inf",
    )
    group.add_argument("--data", action="store_true", help="read and check the data too")
    group.add_argument(
        "--checksums",
        metavar="FILE",
        help="sha256sum-format file to compare with (paths relative to the checkpoint); "
        "implies --data",
    )
    group.add_argument(
        "--write-checksums",
        metavar="FILE",
        help="record every file's sha256 in sha256sum format (written atomically; not "
        "written when a checksum mismatches); implies --data",
    )
    group.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="report NaN/Inf without failing; implies --data",
    )
    group.add_argument("--threads", type=int, default=None, metavar="N", help="files read at once")


def wants_data(args: argparse.Namespace) -> bool:
    """Whether the command line asks for the data pass."""
    return bool(args.data or args.checksums or args.write_checksums or args.allow_nonfinite)


def run_data_pass(args: argparse.Namespace, layout: CheckpointLayout) -> tuple[VerifyReport, bool]:
    """Verify the data of ``layout`` (validated already from ``args.path``) with a progress
    line on terminals; write checksums if asked.

    Returns:
        The report, and whether the checksum file was written.

    Raises:
        CheckpointError: As :func:`hyperckpt.verify`.
        ValueError: ``--threads`` is below 1.
    """
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    line = ProgressLine("verify")
    report = verify_layout(
        layout,
        checksums=args.checksums,
        threads=args.threads,
        progress=line if line.enabled else None,
    )
    written = False
    if args.write_checksums and not report.mismatches:
        write_checksums(
            args.write_checksums,
            {f.name: f.sha256 for f in report.files if f.sha256 is not None},
        )
        written = True
    return report, written


def report_json(report: VerifyReport, *, allow_nonfinite: bool) -> dict[str, Any]:
    """The report as JSON-ready values."""
    return {
        "ok": report.ok(allow_nonfinite=allow_nonfinite),
        "bytes_read": report.bytes_read,
        "seconds": report.seconds,
        "checksum_file": report.checksum_file,
        "files": [
            {
                "name": f.name,
                "size": f.size,
                "sha256": f.sha256,
                "missing": f.missing,
                "ok": f.ok,
                "expected": [
                    {"digest": e.digest, "algorithm": e.algorithm, "source": e.source}
                    for e in f.expected
                ],
                "mismatched": [e.source for e in f.mismatched],
            }
            for f in report.files
        ],
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "files": list(t.files),
                "elements": t.elements,
                "nan": t.nan,
                "posinf": t.posinf,
                "neginf": t.neginf,
                "all_zero": t.all_zero,
            }
            for t in report.tensors
        ],
    }


def print_report(report: VerifyReport, *, allow_nonfinite: bool, written: str | None) -> None:
    """The data pass for people: throughput, checksums, a per-dtype table, the problems.

    File and tensor names come from the checkpoint: every line goes out through
    :func:`_say`, so a name holding a newline, a carriage return, a Unicode line break or
    an ANSI escape cannot start a line of its own (a forged ``result: OK``).
    """
    rate = report.bytes_read / report.seconds / 1e9 if report.seconds > 0 else 0.0
    _say(
        f"data: read {format_bytes(report.bytes_read)} of {len(report.files)} files once in "
        f"{report.seconds:.2f} s ({rate:.2f} GB/s)"
    )
    checked = [f for f in report.files if f.expected]
    sources = sorted({e.source.split(":")[0] for f in checked for e in f.expected})
    _say(
        f"checksums: {len(checked) - len(report.mismatches)} of {len(checked)} checked files "
        f"match ({', '.join(sources) or 'no checksum source'}); "
        f"{len(report.unchecked)} files without a checksum"
    )
    for f in report.mismatches[:_SHOWN]:
        if f.missing:
            _say(f"  MISSING  {f.name} (listed in {f.expected[0].source})")
        for e in f.mismatched:
            got = f.sha256 if e.algorithm == "sha256" else "a different git blob id"
            _say(f"  MISMATCH {f.name}: {e.algorithm} is {got}, {e.source} says {e.digest}")
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for t in report.tensors:
        row = rows[t.dtype]
        row[0] += 1
        row[1] += t.elements
        row[2] += t.nan
        row[3] += t.posinf
        row[4] += t.neginf
        row[5] += t.all_zero
    _say(
        f"  {'dtype':<12}{'tensors':>9}{'values':>15}{'NaN':>10}{'+Inf':>10}{'-Inf':>10}"
        f"{'all-zero':>10}"
    )
    for dtype in sorted(rows):
        n, values, nan, pos, neg, zero = rows[dtype]
        _say(f"  {dtype:<12}{n:>9}{values:>15}{nan:>10}{pos:>10}{neg:>10}{zero:>10}")
    bad = report.nonfinite
    if bad:
        _say(f"tensors with NaN/Inf: {len(bad)}" + (" (allowed)" if allow_nonfinite else ""))
        for t in bad[:_SHOWN]:
            _say(
                f"  {t.name}  {t.dtype}  NaN {t.nan}  +Inf {t.posinf}  -Inf {t.neginf}  "
                f"of {t.elements}  in {', '.join(t.files)}"
            )
        if len(bad) > _SHOWN:
            _say(f"  ... ({len(bad) - _SHOWN} more)")
    zeros = report.all_zero
    if zeros:
        names = preview([t.name for t in zeros], _SHOWN, quote=False)
        _say(f"all-zero tensors (not an error): {len(zeros)}: {names}")
    if written:
        _say(f"checksums written to {written}")
    ok = report.ok(allow_nonfinite=allow_nonfinite)
    _say(f"result: {'OK' if ok else 'FAILED'}")


def _say(line: str) -> None:
    """Print one line of the report, every character that is not printable escaped."""
    print(printable(line))


def validate_data(
    args: argparse.Namespace, summary: dict[str, Any] | None, layout: CheckpointLayout
) -> bool:
    """Run the data pass for a valid checkpoint (``layout``, validated from ``args.path``);
    print (or add to ``summary`` for --json).

    Returns:
        Whether the data checks out.
    """
    report, written = run_data_pass(args, layout)
    allow = bool(args.allow_nonfinite)
    if summary is not None:
        summary["data"] = report_json(report, allow_nonfinite=allow)
        summary["data"]["checksums_written"] = args.write_checksums if written else None
    else:
        print_report(
            report, allow_nonfinite=allow, written=args.write_checksums if written else None
        )
        if args.write_checksums and not written:
            _say(f"checksums NOT written to {args.write_checksums}: a file does not match")
    return report.ok(allow_nonfinite=allow)

"""The coordinator's planning alone, user and system CPU apart, several times in one process.

``simulate_scale.py --columns`` times the coordinator (price, plan the winner, cut the
shares) once per cell among many other measures, which takes minutes at 8,192 ranks.
This runs only that step, as ``simulate_columns`` runs it, ``--repeat`` times on the same
requests, and prints one line per run with its user and system seconds (``getrusage``):
the growth from 1,024 to 8,192 ranks is mostly system time (memory faulted in), which
``time.process_time`` adds in unseen.  Compare two checkouts by running this from each.
With ``--small-pages`` numpy's huge-page advice is off, so every fault is one 4 KiB page
and the minor faults count the fresh memory a run touches (with the advice a fault of a
large array is 2 MiB and the count says little); the times then differ from a plain run.

    PYTHONPATH=$PWD python benchmarks/coordinator_growth.py --layout fsdp --world 8192
"""

from __future__ import annotations

import argparse
import gc
import resource

import numpy as np
from placed_requests import placed_requests
from simulate_columns import BATCH_BYTES
from simulate_scale import MODELS, RANKS_PER_HOST, synthetic_layout

from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._cli.dryrun import hosts_of
from hyperckpt._exchange.pricing import price_and_plan
from hyperckpt._exchange.stripe_plan import chunk_table, plan_stripe_arrays
from hyperckpt._exchange.stripe_shares import cut_shares
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt.types import CostModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-70b", choices=list(MODELS))
    parser.add_argument("--layout", default="fsdp")
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--small-pages",
        action="store_true",
        help="numpy's huge-page advice off: print the memory faulted in per run (4 KiB a fault)",
    )
    args = parser.parse_args()
    if args.small_pages:
        np._core.multiarray._set_madvise_hugepage(False)
    shapes, files = MODELS[args.model]
    hosts = max(1, args.world // RANKS_PER_HOST)
    requests, columns = placed_requests(
        synthetic_layout(shapes(), files),
        args.layout,
        args.world,
        tp=min(RANKS_PER_HOST, args.world),
        replicas=hosts,
    )
    names = hosts_of(args.world, hosts)
    table = chunk_table(columns.chunks)

    def plan(best: str) -> list[object]:
        # The replicated exchange, where it wins, is timed by simulate_columns.
        if best != "striped":
            return []
        planned = plan_stripe_arrays(columns, round_bytes=DEFAULT_STAGING_BYTES)
        return list(cut_shares(planned, table))

    for run in range(args.repeat):
        gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF)
        with collector_paused():
            best, shares, _ = price_and_plan(
                requests,
                names,
                CostModel(),
                plan,
                round_bytes=DEFAULT_STAGING_BYTES,
                batch_bytes=BATCH_BYTES,
            )
        after = resource.getrusage(resource.RUSAGE_SELF)
        user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        faulted = ""
        if args.small_pages:
            faulted = f", faulted {(after.ru_minflt - before.ru_minflt) * 4 / 1024:.0f} MiB"
        print(
            f"{args.model} {args.layout} {args.world} run {run}: {best}, "
            f"user {user:.2f} s, system {system:.2f} s, CPU {user + system:.2f} s{faulted}"
        )
        del shares


if __name__ == "__main__":
    main()

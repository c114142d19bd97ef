"""Markdown tables and the issue-4 targets (PASS/MISS) for ``batching.py``'s runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batching_probe import BATCH_SIZES, RawPoint, compute_ms_at

if TYPE_CHECKING:
    from batching import Run

KILN_UNBATCHED, TRITON = "kiln unbatched", "Triton batched"
KILN_BATCHED = ("kiln batched x1", "kiln batched x2")
TOP_GROUPS = 5


def _points(run: Run) -> list[RawPoint]:
    return [
        RawPoint(int(p["callers"]), int(p["intra"]), int(p["batch"]), int(p["calls"]), p["seconds"])
        for p in run.raw
    ]


def raw_best(run: Run) -> float:
    return max(p.inferences_per_s for p in _points(run))


def raw_table(runs: list[Run]) -> list[str]:
    head = "| raw ORT measured before | callers x intra-op | " + " | ".join(
        f"b={b} inf/s (ms/run)" for b in BATCH_SIZES
    )
    lines = [head + " |", "|---|---|" + "--:|" * len(BATCH_SIZES)]
    seen = set()
    for run in runs:
        if run.server in seen:
            continue
        seen.add(run.server)
        points = _points(run)
        for layout in sorted({(p.callers, p.intra) for p in points}):
            cells = [
                f"{p.inferences_per_s:,.0f} ({p.compute_ms:.3f})"
                for p in points
                if (p.callers, p.intra) == layout
            ]
            lines.append(
                f"| {run.server} | {layout[0]} x {layout[1]} | " + " | ".join(cells) + " |"
            )
    return lines


def run_table(runs: list[Run]) -> list[str]:
    lines = [
        "| server | protocol | req/s | p50 ms | p99 ms | avg batch | queue ms | compute ms "
        "| server CPU µs/req | loadgen CPU µs/req | server threads, % of one core (top groups) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in runs:
        batch = f"{r.avg_batch:.1f}" if r.avg_batch is not None else "n/a"
        queue = f"{r.queue_ms:.2f}" if r.queue_ms is not None else "n/a"
        compute = f"{r.compute_ms:.2f}" if r.compute_ms is not None else "n/a"
        groups = ", ".join(
            f"{g} {cpu / r.seconds * 100:.0f}" for g, cpu in list(r.threads.items())[:TOP_GROUPS]
        )
        lines.append(
            f"| {r.server} | {r.protocol} | {r.throughput:,.0f} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {batch} | {queue} | {compute} | "
            f"{r.server_cpu_s / r.requests * 1e6:,.0f} | "
            f"{r.loadgen_cpu_s / r.requests * 1e6:,.0f} | {groups} |"
        )
    return lines


def targets(runs: list[Run], delay_us: int) -> list[str]:
    """The issue's four targets for each kiln batched configuration and protocol."""
    by = {(r.server, r.protocol): r for r in runs}
    lines = [
        "| kiln config | protocol | x Triton batched (≥ 1.5) | x kiln unbatched (≥ 4) "
        "| of raw best batched (≥ 60 %) | p99 ms vs bound ms |",
        "|---|---|--:|--:|--:|--:|",
    ]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    for name in KILN_BATCHED:
        for protocol in ("gRPC", "HTTP/binary"):
            k = by.get((name, protocol))
            if k is None:
                continue
            cells = []
            for peer, goal in ((TRITON, 1.5), (KILN_UNBATCHED, 4.0)):
                other = by.get((peer, protocol))
                if other is None:
                    cells.append("not run")
                else:
                    ratio = k.throughput / other.throughput
                    cells.append(f"{ratio:.2f} {verdict(ratio >= goal)}")
            ratio = k.throughput / raw_best(k)
            cells.append(f"{ratio:.1%} {verdict(ratio >= 0.6)}")
            if k.avg_batch is None:
                cells.append("no batch statistics")
            else:
                bound = delay_us / 1000 + 2 * compute_ms_at(_points(k), k.avg_batch)
                cells.append(f"{k.p99_ms:.2f} vs {bound:.2f} {verdict(k.p99_ms <= bound)}")
            lines.append(f"| {name} | {protocol} | " + " | ".join(cells) + " |")
    return lines


def report(runs: list[Run], delay_us: int) -> str:
    parts = [raw_table(runs), run_table(runs), targets(runs, delay_us)]
    return "\n\n".join("\n".join(p) for p in parts)

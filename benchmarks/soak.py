"""Soak: minutes of mixed load on kiln while models reload and Python workers get killed.

Builds the example repository, starts ``kiln serve --model-control-mode explicit
--load-model '*'`` and, for ``--duration`` seconds, keeps ``--workers`` threads sending
requests to every example model (HTTP binary and gRPC; sequences START..END; the decoupled
``repeat_int32`` through gRPC streaming) while a controller reloads ``mlp``, unloads and
reloads ``simple_string`` and SIGKILLs one Python-backend worker every ``--kill-every``
seconds. Every request has a client timeout. A failure is *expected* only when it overlaps
an event on the same model (from the event until it is over, plus a grace period); any
other failure, any hung or lost request, a wrong answer, or RSS growing more than
``--max-rss-growth`` from the mark (the first minute, or a quarter of a short run) to the
end makes the exit status 1. Usage::

    .venv/bin/python benchmarks/soak.py --duration 600 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tritonclient.http as httpclient
from rich.console import Console
from rich.table import Table
from soak_server import SoakServer
from soak_traffic import DECOUPLED_MODELS, SEQUENCE_MODELS, Outcome, Traffic, model_inputs

from kiln.examples import build_example_repository

GRACE_S = 5.0  # after an event ends, failures on its model still count as its doing


@dataclass(slots=True)
class Event:
    kind: str  # kill, reload, unload
    model: str
    start: float
    end: float = 0.0
    detail: str = ""


def controller(
    server: SoakServer,
    opts: argparse.Namespace,
    t0: float,
    stop: threading.Event,
    events: list[Event],
) -> None:
    """Reload mlp, unload+load simple_string (offset by half a period), kill a worker."""
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    next_reload = t0 + opts.reload_every
    next_unload = t0 + opts.reload_every / 2
    next_kill = t0 + opts.kill_every
    kills = 0
    while not stop.wait(0.2):
        now = time.monotonic()
        if now >= next_reload:
            next_reload += opts.reload_every
            event = Event("reload", "mlp", now)
            events.append(event)
            _control(client.load_model, "mlp", event)
        if now >= next_unload:
            next_unload += opts.reload_every
            event = Event("unload", "simple_string", now)
            events.append(event)
            _control(client.unload_model, "simple_string", event)
            stop.wait(1.0)  # requests meet the unloaded model for a while
            _control(client.load_model, "simple_string", event)
        if now >= next_kill:
            next_kill += opts.kill_every
            model = ("python_preprocess", "repeat_int32")[kills % 2]
            kills += 1
            events.append(_kill(server, model, stop))
    client.close()


def _control(call: Any, model: str, event: Event) -> None:
    try:
        call(model)
    except Exception as exc:  # recorded: a failed load/unload is a finding, not a crash
        event.detail += f"{call.__name__} failed: {exc}; "
    event.end = time.monotonic()


def _kill(server: SoakServer, model: str, stop: threading.Event) -> Event:
    before = {pid for pid, m in server.python_workers().items() if m == model}
    event = Event("kill", model, time.monotonic())
    if not before:
        event.detail, event.end = "no worker found", event.start
        return event
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    # The server notices the death on the next request, fails it, restarts the worker.
    deadline = event.start + 60
    while time.monotonic() < deadline and not stop.is_set():
        now = {pid for pid, m in server.python_workers().items() if m == model}
        if now - before:
            event.detail = f"pid {victim} killed; restarted as {min(now - before)}"
            break
        stop.wait(0.2)
    else:
        event.detail = f"pid {victim} killed; no restart seen"
    event.end = time.monotonic()
    return event


def load_thread(
    traffic: Traffic, specs: dict[str, Any], seed: int, deadline: float, outcomes: list[Outcome]
) -> None:
    rng = random.Random(seed)
    plain = sorted(specs)
    try:
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.12:
                outcome = traffic.sequence(rng.choice(SEQUENCE_MODELS), rng)
            elif roll < 0.24:
                outcome = traffic.stream(DECOUPLED_MODELS[0], rng)
            else:
                protocol = rng.choice(("http", "grpc"))
                model = rng.choice(plain)
                outcome = traffic.infer(model, specs[model], protocol, rng)
            outcomes.append(outcome)  # list.append is atomic under the GIL
    finally:
        traffic.close()


def sample_rss(
    server: SoakServer,
    t0: float,
    every: float,
    stop: threading.Event,
    samples: list[tuple[float, float, float]],
) -> None:
    while True:
        tree, own = server.rss_mib()
        samples.append((round(time.monotonic() - t0, 1), round(tree, 1), round(own, 1)))
        if stop.wait(every):
            return


# An ensemble fails with its composing model: a kill or unload of a step is felt by both.
COMPOSED_OF = {
    "cnn_pipeline": ("image_preprocess", "cnn", "postprocess"),
    "python_pipeline": ("python_preprocess", "cnn", "postprocess"),
}


def expected(outcome: Outcome, events: list[Event]) -> bool:
    affected = {outcome.model, *COMPOSED_OF.get(outcome.model, ())}
    for event in events:
        end = (event.end or time.monotonic()) + GRACE_S
        if event.model in affected and outcome.start <= end and outcome.end >= event.start:
            return True
    return False


def _slope_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    var = sum((p[0] - mx) ** 2 for p in points)
    return 60 * sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else 0.0


def summarize(
    outcomes: list[Outcome],
    events: list[Event],
    samples: list[tuple[float, float, float]],
    opts: argparse.Namespace,
    log: str,
    exit_status: int | None,
) -> dict[str, Any]:
    kinds: Counter[str] = Counter()
    groups: Counter[tuple[str, str, str, bool]] = Counter()
    per_model: dict[str, Counter[str]] = {}
    for o in outcomes:
        kinds["sent"] += o.requests
        label = o.kind
        if o.kind == "failed":
            ok = expected(o, events)
            label = "failed_expected" if ok else "failed_unexpected"
            groups[(o.model, o.status, o.message[:110], ok)] += 1
        elif o.kind != "ok":
            groups[(o.model, o.status or o.kind, o.message[:110], False)] += 1
        kinds[label] += o.requests
        per_model.setdefault(f"{o.model} ({o.protocol})", Counter())[label] += o.requests
    mark = min(60.0, opts.duration / 4)
    after = [(t, tree) for t, tree, _ in samples if t >= mark]
    rss_mark = after[0][1] if after else samples[0][1]
    rss_end = samples[-1][1]
    growth = (rss_end - rss_mark) / rss_mark if rss_mark else 0.0
    bad = sum(kinds[k] for k in ("wrong", "hung", "lost", "failed_unexpected"))
    return {
        "duration_s": opts.duration,
        "workers": opts.workers,
        "timeout_s": opts.timeout,
        "server_args": opts.server_arg,
        "requests": {
            k: kinds[k]
            for k in ("sent", "ok", "failed_expected", "failed_unexpected", "wrong", "hung", "lost")
        },
        "errors": [
            {"model": m, "status": s, "message": msg, "expected": e, "count": n}
            for (m, s, msg, e), n in groups.most_common()
        ],
        "per_model": {k: dict(v) for k, v in sorted(per_model.items())},
        "events": [
            asdict(e) | {"start": round(e.start - opts.t0, 1), "end": round(e.end - opts.t0, 1)}
            for e in events
        ],
        "worker_restarts_logged": log.count("Python worker restarted"),
        "rss_mib": {
            "start": samples[0][1],
            "mark_s": mark,
            "at_mark": rss_mark,
            "end": rss_end,
            "max": max(s[1] for s in samples),
            "growth_from_mark": round(growth, 4),
            "trend_mib_per_min": round(_slope_per_min(after), 3),
            "server_only_start": samples[0][2],
            "server_only_end": samples[-1][2],
            "samples": samples,
        },
        "server_exit_status": exit_status,
        "pass": bad == 0 and growth <= opts.max_rss_growth,
    }


def report(result: dict[str, Any]) -> None:
    console = Console(width=150)
    table = Table(title=f"kiln soak: {result['duration_s']:g} s, {result['workers']} workers")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result["requests"].items():
        table.add_row(f"requests {key}", str(value))
    counts = Counter(e["kind"] for e in result["events"])
    for kind in ("kill", "reload", "unload"):
        table.add_row(f"events {kind}", str(counts[kind]))
    table.add_row("worker restarts (log)", str(result["worker_restarts_logged"]))
    rss = result["rss_mib"]
    for key in ("start", "at_mark", "end", "max", "server_only_start", "server_only_end"):
        table.add_row(f"RSS {key} (MiB)", f"{rss[key]:.1f}")
    table.add_row("RSS growth mark->end", f"{100 * rss['growth_from_mark']:.1f} %")
    table.add_row("RSS trend after mark", f"{rss['trend_mib_per_min']:+.2f} MiB/min")
    table.add_row("server exit status", str(result["server_exit_status"]))
    table.add_row("pass", str(result["pass"]))
    console.print(table)
    errors = Table(title="failures by model, status and message")
    for column in ("model", "status", "message", "expected", "count"):
        errors.add_column(column)
    for e in result["errors"]:
        errors.add_row(e["model"], e["status"], e["message"], str(e["expected"]), str(e["count"]))
    console.print(errors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=30.0, help="client timeout per request")
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--reload-every", type=float, default=30.0)
    parser.add_argument("--rss-every", type=float, default=10.0)
    parser.add_argument("--check-every", type=int, default=3, help="check every Nth answer")
    parser.add_argument("--max-rss-growth", type=float, default=0.20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `kiln serve` flag; may repeat"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-soak-") as tmp:
        work = Path(tmp)
        build_example_repository(work / "models")
        server = SoakServer(work / "models", work, extra_args=tuple(opts.server_arg))
        server.start()
        try:
            models = [
                r["name"]
                for r in httpclient.InferenceServerClient(
                    server.http_url
                ).get_model_repository_index()
                if r.get("state") == "READY"
            ]
            plain = [m for m in models if m not in SEQUENCE_MODELS + DECOUPLED_MODELS]
            specs = model_inputs(server.http_url, plain)
            outcomes: list[Outcome] = []
            events: list[Event] = []
            samples: list[tuple[float, float, float]] = []
            stop = threading.Event()
            opts.t0 = t0 = time.monotonic()
            deadline = t0 + opts.duration
            threads = [
                threading.Thread(
                    target=sample_rss, args=(server, t0, opts.rss_every, stop, samples)
                ),
                threading.Thread(target=controller, args=(server, opts, t0, stop, events)),
            ]
            loaders = [
                threading.Thread(
                    target=load_thread,
                    args=(
                        Traffic(server.http_url, server.grpc_url, opts.timeout, opts.check_every),
                        specs,
                        opts.seed * 1000 + i,
                        deadline,
                        outcomes,
                    ),
                )
                for i in range(opts.workers)
            ]
            for thread in threads + loaders:
                thread.start()
            for thread in loaders:
                thread.join()
            stop.set()
            for thread in threads:
                thread.join()
            tree, own = server.rss_mib()
            samples.append((round(time.monotonic() - t0, 1), round(tree, 1), round(own, 1)))
        finally:
            exit_status = server.stop()
        result = summarize(
            outcomes,
            events,
            samples,
            opts,
            server.log_path.read_text(errors="replace"),
            exit_status,
        )
    report(result)
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

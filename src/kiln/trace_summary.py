"""``kiln trace summary``: where traced requests spent their time, per model and protocol.

Reads trace files in Triton's format (kiln's ``--trace-config triton,file=...``, or
Triton's own) and averages, per model version and protocol, the phases Triton's
``trace_summary.py`` reports: receive, the server's handling (queue, compute input /
infer / output) and send.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: (phase, from stamp, to stamp); a phase a trace lacks a stamp of is left out for it.
PHASES = (
    ("request", None, None),  # first to last stamp of the trace
    ("receive", "RECV_START", "RECV_END"),
    ("handler", "REQUEST_START", "REQUEST_END"),
    ("queue", "QUEUE_START", "COMPUTE_START"),
    ("compute", "COMPUTE_START", "COMPUTE_END"),
    ("compute input", "COMPUTE_START", "COMPUTE_INPUT_END"),
    ("compute infer", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
    ("compute output", "COMPUTE_OUTPUT_START", "COMPUTE_END"),
    ("first token", "REQUEST_START", "FIRST_TOKEN"),  # an LLM request's
    ("send", "SEND_START", "SEND_END"),
)


class TraceFileError(ValueError):
    """A file that is not a trace file, with the reason and the file's name."""


@dataclass(slots=True)
class Group:
    """The traces of one (model, version, protocol)."""

    model: str
    version: int
    protocol: str  # "HTTP", "GRPC", or "in-server" (an ensemble's step, a BLS call, ...)
    count: int = 0
    totals: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def mean_us(self, phase: str) -> float | None:
        n = self.counts.get(phase, 0)
        return self.totals[phase] / n / 1000 if n else None


def read_entries(paths: list[Path]) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise TraceFileError(f"{path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise TraceFileError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
        except UnicodeDecodeError as exc:
            raise TraceFileError(f"{path}: not UTF-8 (byte {exc.start})") from None
        except RecursionError:
            raise TraceFileError(f"{path}: not JSON (nested too deep)") from None
        except ValueError as exc:  # an integer past Python's 4,300 digits
            raise TraceFileError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, list) or not all(isinstance(e, dict) and "id" in e for e in data):
            raise TraceFileError(
                f"{path}: not a trace file (expected a JSON array of objects with an 'id')"
            )
        for i, entry in enumerate(data):
            problem = _entry_problem(entry)
            if problem:
                raise TraceFileError(f"{path}: entry {i}: {problem}")
        entries.extend(data)
    return entries


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry_problem(entry: dict[str, Any]) -> str:
    """What is wrong with one entry for ``summarize``, or ""."""
    if not _is_int(entry["id"]):
        return "'id' must be an integer"
    if "model_name" in entry and not isinstance(entry["model_name"], str):
        return "'model_name' must be a string"
    version = entry.get("model_version", -1)
    if not (
        _is_int(version) or (isinstance(version, str) and version.isdigit() and len(version) <= 19)
    ):
        return "'model_version' must be an integer"
    stamps = entry.get("timestamps", [])
    if not isinstance(stamps, list) or not all(
        isinstance(s, dict) and isinstance(s.get("name"), str) and _is_int(s.get("ns"))
        for s in stamps
    ):
        return '\'timestamps\' must be a list of {"name": string, "ns": integer}'
    return ""


def summarize(entries: list[dict[str, Any]]) -> list[Group]:
    heads: dict[int, dict[str, Any]] = {}
    stamps: dict[int, dict[str, int]] = defaultdict(dict)
    for entry in entries:
        if "model_name" in entry:
            heads[entry["id"]] = entry
        for stamp in entry.get("timestamps", ()):
            # "HTTP_RECV_START" and "GRPC_WAITREAD_START" are one phase's start
            name = stamp["name"].replace("WAITREAD", "RECV")
            stamps[entry["id"]].setdefault(name, int(stamp["ns"]))
    groups: dict[tuple[str, int, str], Group] = {}
    for trace_id, head in heads.items():
        own = stamps.get(trace_id, {})
        protocol = next((p for p in ("HTTP", "GRPC") if f"{p}_RECV_START" in own), "in-server")
        key = (head["model_name"], int(head.get("model_version", -1)), protocol)
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group(*key)
        group.count += 1
        plain = {name.split("_", 1)[1] if name.startswith(("HTTP_", "GRPC_")) else name: ns
                 for name, ns in own.items()}  # fmt: skip
        for phase, start, end in PHASES:
            if start is None or end is None:
                if len(own) >= 2:
                    span = max(own.values()) - min(own.values())
                else:
                    continue
            elif start in plain and end in plain:
                span = plain[end] - plain[start]
            else:
                continue
            group.totals[phase] += span
            group.counts[phase] += 1
    return sorted(groups.values(), key=lambda g: (g.model, g.version, g.protocol))


def to_json(groups: list[Group]) -> list[dict[str, Any]]:
    return [
        {
            "model_name": g.model,
            "model_version": g.version,
            "protocol": g.protocol,
            "traces": g.count,
            "mean_us": {
                phase: round(v, 1) for phase, _, _ in PHASES if (v := g.mean_us(phase)) is not None
            },
        }
        for g in groups
    ]

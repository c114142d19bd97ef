"""Read, write and check Triton-style model configurations (``config.pbtxt``)."""

from __future__ import annotations

import difflib
import inspect
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from google.protobuf import descriptor, json_format, text_format

from kiln.config.ensemble_graph import graph_problems
from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "ConfigError",
    "config_from_json",
    "config_to_json",
    "find_line",
    "load_config_file",
    "parse_config_text",
    "validate_config",
]

DEFAULT_CONFIG_NAME = "config.pbtxt"
JSON_OVERRIDE_PATH = "<config override>"

# Users write Triton configs and know "ModelConfig", not kiln's proto package.
_PACKAGE_PREFIX = ModelConfig.DESCRIPTOR.full_name.rsplit(".", 1)[0] + "."
_POOL = ModelConfig.DESCRIPTOR.file.pool

_INT64_TYPES = frozenset(
    {
        descriptor.FieldDescriptor.TYPE_INT64,
        descriptor.FieldDescriptor.TYPE_UINT64,
        descriptor.FieldDescriptor.TYPE_SINT64,
        descriptor.FieldDescriptor.TYPE_FIXED64,
        descriptor.FieldDescriptor.TYPE_SFIXED64,
    }
)

# protobuf 5.26 renamed including_default_value_fields (and changed what it prints).
if (
    "always_print_fields_with_no_presence"
    in inspect.signature(json_format.MessageToDict).parameters
):
    _PRINT_DEFAULTS = {"always_print_fields_with_no_presence": True}
else:  # pragma: no cover - protobuf < 5.26
    _PRINT_DEFAULTS = {"including_default_value_fields": True}


class ConfigError(Exception):
    """A problem in a model configuration, located as precisely as we can."""

    def __init__(
        self,
        message: str,
        path: str = "<config>",
        line: int | None = None,
        column: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.column = column
        self.field = field

    def __str__(self) -> str:
        where = ":".join(str(p) for p in (self.path, self.line, self.column) if p not in (None, ""))
        return f"{where}: {self.message}" if where else self.message

    def __repr__(self) -> str:
        return f"ConfigError({self!s})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep every attribute when the error crosses a process boundary.
        return (type(self), (self.message, self.path, self.line, self.column, self.field))

    def sort_key(self) -> tuple[str, int, int, str]:
        return (self.path, self.line or 0, self.column or 0, self.message)


# ---------------------------------------------------------------------------- text format


def parse_config_text(text: str, path: str = "<config>") -> ModelConfig:
    cfg = ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as exc:
        raise _text_error(exc, text, path) from None
    return cfg


def load_config_file(path: str | Path) -> ModelConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read model configuration: {exc}", str(path)) from None
    return parse_config_text(text, str(path))


_UNKNOWN_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)"')
_BAD_ENUM = re.compile(r'Enum type "([\w.]+)" has no value named ([^.\s]+)')
_BAD_VALUE = re.compile(r"Couldn't parse|Value out of range|Invalid|Enum type")
_NAMED_FIELD = re.compile(r'(?:multiple|Field) "(\w+)"')
_REPEATED = re.compile(r'Message type "(\w+)" should not have multiple "(\w+)" fields')
# The context line that text_format quotes before its message: `'...': `.
_QUOTED_CONTEXT = re.compile(r"^'.*?': ", re.DOTALL)
_KEY_BEFORE_VALUE = re.compile(r"([A-Za-z_]\w*)\s*:\s*(?:\[[^\]]*)?$")


def _text_error(exc: text_format.ParseError, text: str, path: str) -> ConfigError:
    line, column = exc.GetLine(), exc.GetColumn()
    raw = re.sub(r"^\d+:\d+ : ", "", str(exc))
    raw = _QUOTED_CONTEXT.sub("", raw).rstrip(".")
    if m := _UNKNOWN_FIELD.search(raw):
        type_name, field = m.groups()
        message = f'unknown field "{field}" in {_short(type_name)}'
        return ConfigError(
            message + _suggest(field, _field_names(type_name)), path, line, column, field
        )
    field = None
    if _BAD_VALUE.search(raw):  # these name the value, not its field: take the key before it
        field = _key_before(text, line, column)
    elif m := _NAMED_FIELD.search(raw):
        field = m.group(1)
    if m := _BAD_ENUM.search(raw):
        enum_name, value = m.groups()
        known = [v.name for v in _POOL.FindEnumTypeByName(enum_name).values]
        where = f' for field "{field}"' if field else ""
        message = f"invalid value {value}{where} (a {_short(enum_name)}){_suggest(value, known)}"
        return ConfigError(message, path, line, column, field)
    message = _short(raw)
    if m := _REPEATED.search(message):
        message = f'field "{m.group(2)}" is set more than once in {m.group(1)}'
    if field and f'"{field}"' not in message:
        message = f'field "{field}": {message}'
    return ConfigError(message, path, line, column, field)


def _key_before(text: str, line: int | None, column: int | None) -> str | None:
    lines = text.splitlines()
    if line is None or column is None or not 0 < line <= len(lines):
        return None
    key = _KEY_BEFORE_VALUE.search(lines[line - 1][: column - 1])
    return key.group(1) if key else None


def _field_names(type_name: str) -> list[str]:
    if not type_name.startswith(_PACKAGE_PREFIX):
        type_name = _PACKAGE_PREFIX + type_name
    return [f.name for f in _POOL.FindMessageTypeByName(type_name).fields]


def _short(text: str) -> str:
    return text.replace(_PACKAGE_PREFIX, "")


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1)
    if not close:
        # Enum values carry a prefix people leave out (NCHW for FORMAT_NCHW, FP32 for TYPE_FP32).
        close = [c for c in candidates if c.upper().endswith("_" + word.upper())][:1]
    return f'; did you mean "{close[0]}"?' if close else ""


# ---------------------------------------------------------------------------- JSON


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """The JSON Triton serves at ``GET /v2/models/{model}/config``."""
    data = json_format.MessageToDict(cfg, preserving_proto_field_name=True, **_PRINT_DEFAULTS)
    _int64_to_numbers(cfg.DESCRIPTOR, data)
    return cast("dict[str, Any]", data)


def _int64_to_numbers(desc: descriptor.Descriptor, data: dict[str, Any]) -> None:
    # proto3 JSON writes 64-bit integers as strings; Triton (and its clients) use numbers.
    for name, value in data.items():
        field = desc.fields_by_name.get(name)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():  # map keys stay strings: JSON object keys
                value[key] = _convert(value_field, item)
        elif _is_repeated(field):
            data[name] = [_convert(field, item) for item in value]
        else:
            data[name] = _convert(field, value)


def _convert(field: descriptor.FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        _int64_to_numbers(field.message_type, value)
        return value
    if field.type in _INT64_TYPES and isinstance(value, str):
        return int(value)
    return value


def _is_repeated(field: descriptor.FieldDescriptor) -> bool:
    # FieldDescriptor.label is deprecated in newer protobuf releases.
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return bool(field.label == descriptor.FieldDescriptor.LABEL_REPEATED)


def config_from_json(data: str | bytes | dict[str, Any]) -> ModelConfig:
    """Parse a JSON config (the repository load API's ``config`` override)."""
    path = JSON_OVERRIDE_PATH
    if isinstance(data, str | bytes):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid JSON: {exc.msg}", path, exc.lineno, exc.colno) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"invalid JSON: {exc}", path) from None
        except RecursionError:  # Python's parser gives up on deep nesting this way
            raise ConfigError("invalid JSON: nested too deeply", path) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"a model configuration must be a JSON object, not {type(data).__name__}", path
        )
    cfg = ModelConfig()
    try:
        json_format.ParseDict(data, cfg)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise _json_error(str(exc), path) from None
    except RecursionError:
        raise ConfigError("invalid JSON: nested too deeply", path) from None
    return cfg


_JSON_UNKNOWN = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)" at "([^"]*)"')
_JSON_FIELD = re.compile(r"Failed to parse (\w+) field: ")


def _json_error(raw: str, path: str) -> ConfigError:
    raw = _short(raw.split("\n", 1)[0].rstrip("."))  # drop the list of available fields
    if m := _JSON_UNKNOWN.search(raw):
        type_name, field, where = m.groups()
        message = f'unknown field "{field}" in {where or _short(type_name)}'
        return ConfigError(message + _suggest(field, _field_names(type_name)), path, field=field)
    # Nested failures read "Failed to parse a field: Failed to parse b field: <why>".
    if fields := _JSON_FIELD.findall(raw):
        why = _JSON_FIELD.split(raw)[-1]
        return ConfigError(f'field "{fields[-1]}": {why}', path, field=fields[-1])
    m = _NAMED_FIELD.search(raw)
    return ConfigError(raw, path, field=m.group(1) if m else None)


# ---------------------------------------------------------------------------- locating fields

_KEY = re.compile(r"([A-Za-z_]\w*)\s*(?::|(?=[{<\[]))\s*")


def find_line(
    text: str | None,
    field_name: str,
    value: str | None = None,
    *,
    top_level: bool = False,
    nth: int = 1,
) -> int | None:
    """1-based line of the ``nth`` ``field_name`` key in text-format ``text``.

    ``value`` restricts matches to keys followed by that (unquoted) string value;
    ``top_level`` to keys of the ModelConfig itself, not of nested messages.
    """
    if not text:
        return None
    depth = seen = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        i = 0
        while i < len(line):
            ch = line[i]
            if ch == "#":
                break
            if ch in "\"'":
                i = _skip_string(line, i)
                continue
            if ch in "{<":
                depth += 1
            elif ch in "}>":
                depth -= 1
            elif (ch.isalpha() or ch == "_") and (
                i == 0 or not (line[i - 1].isalnum() or line[i - 1] == "_")
            ):
                m = _KEY.match(line, i)
                if m and m.group(1) == field_name and (depth == 0 or not top_level):
                    rest = line[m.end() :]
                    if value is None or rest.startswith((f'"{value}"', f"'{value}'")):
                        seen += 1
                        if seen == nth:
                            return lineno
                i += len(m.group(1)) if m else 1
                continue
            i += 1
    return None


def _skip_string(line: str, start: int) -> int:
    quote, i = line[start], start + 1
    while i < len(line):
        if line[i] == "\\":
            i += 2
            continue
        if line[i] == quote:
            return i + 1
        i += 1
    return i


# ---------------------------------------------------------------------------- semantic checks

Report = Callable[[str, str, int | None], None]
_ENSEMBLE = "ensemble"
_BOOL_CONTROLS = ("int32_false_true", "fp32_false_true", "bool_false_true")


def validate_config(
    cfg: ModelConfig, model_dir_name: str, path: str, text: str | None = None
) -> list[ConfigError]:
    """Checks the schema cannot express; Triton refuses to load a model that fails one.

    Runs on the config as written, before auto-complete, so it never demands what
    auto-complete may still fill in (inputs, outputs, max_batch_size).
    """
    problems: list[ConfigError] = []

    def report(field: str, message: str, line: int | None) -> None:
        problems.append(ConfigError(message, path, line, field=field))

    def top(name: str) -> int | None:
        return find_line(text, name, top_level=True)

    if cfg.name and cfg.name != model_dir_name:
        message = f'name "{cfg.name}" does not match the model folder "{model_dir_name}"'
        report("name", message, top("name"))
    if cfg.max_batch_size < 0:
        message = f"max_batch_size must be >= 0, got {cfg.max_batch_size}"
        report("max_batch_size", message, top("max_batch_size"))
    _check_tensors("input", cfg.input, text, report)
    _check_tensors("output", cfg.output, text, report)

    policy = cfg.version_policy
    if policy.HasField("specific") and not policy.specific.versions:
        report(
            "version_policy.specific",
            "version_policy specific lists no versions",
            top("version_policy"),
        )

    for i, group in enumerate(cfg.instance_group):
        line = find_line(text, "instance_group")
        if group.count < 0:
            report(
                f"instance_group[{i}].count",
                f"instance_group count must be >= 0, got {group.count}",
                line,
            )
        if group.gpus and group.kind in (group.KIND_CPU, group.KIND_MODEL):
            kind = group.Kind.Name(group.kind)
            report(
                f"instance_group[{i}].gpus", f"instance_group of kind {kind} cannot list gpus", line
            )

    if cfg.HasField("dynamic_batching"):
        _check_dynamic_batching(cfg, text, report)
    if cfg.HasField("sequence_batching"):
        _check_sequence_batching(cfg, text, report)
    _check_ragged(cfg, text, report)

    is_ensemble = cfg.platform == _ENSEMBLE
    if is_ensemble and cfg.instance_group:
        report(
            "instance_group", "ensemble models cannot have instance_group", top("instance_group")
        )
    if is_ensemble and not cfg.HasField("ensemble_scheduling"):
        report(
            "ensemble_scheduling", 'platform "ensemble" needs ensemble_scheduling', top("platform")
        )
    if cfg.HasField("ensemble_scheduling"):
        line = top("ensemble_scheduling")
        if not is_ensemble:
            report("platform", 'ensemble_scheduling needs platform: "ensemble"', line)
        if not cfg.ensemble_scheduling.step:
            report("ensemble_scheduling.step", "ensemble_scheduling lists no step", line)
        for i, step in enumerate(cfg.ensemble_scheduling.step):
            if not step.model_name:
                field = f"ensemble_scheduling.step[{i}].model_name"
                report(field, f"ensemble step {i} must specify model_name", line)
        if is_ensemble and all(step.model_name for step in cfg.ensemble_scheduling.step):
            # Cycles, unproduced tensors and outputs: a broken graph never loads anything.
            for message in graph_problems(cfg):
                report("ensemble_scheduling", message, line)
    return problems


def _check_tensors(kind: str, tensors: Sequence[Any], text: str | None, report: Report) -> None:
    seen: set[str] = set()
    for i, io in enumerate(tensors):
        where = f"{kind}[{i}]"
        label = f'{kind} "{io.name}"' if io.name else where
        line = (
            find_line(text, "name", io.name) if io.name else find_line(text, kind, top_level=True)
        )
        if not io.name:
            report(f"{where}.name", f"{where} must specify name", line)
        elif io.name in seen:
            dup_line = find_line(text, "name", io.name, nth=2) or line
            report(f"{where}.name", f'duplicate {kind} name "{io.name}"', dup_line)
        seen.add(io.name)
        if io.data_type == 0:  # TYPE_INVALID
            report(f"{where}.data_type", f"{label} must specify data_type", line)
        if not io.dims:
            report(f"{where}.dims", f"{label} must specify dims", line)
        # 0 is refused too: a zero-sized dimension would make the tensor always empty.
        if any(d < 1 and d != -1 for d in io.dims):
            message = f"{label} dims must be >= 1 or -1 (variable), got {list(io.dims)}"
            report(f"{where}.dims", message, line)
        if io.HasField("reshape") and any(d < 1 and d != -1 for d in io.reshape.shape):
            message = f"{label} reshape must be >= 1 or -1, got {list(io.reshape.shape)}"
            report(f"{where}.reshape.shape", message, line)


def _check_dynamic_batching(cfg: ModelConfig, text: str | None, report: Report) -> None:
    db = cfg.dynamic_batching
    field = "dynamic_batching.preferred_batch_size"
    line = find_line(text, "preferred_batch_size") or find_line(text, "dynamic_batching")
    for size in db.preferred_batch_size:
        if size <= 0:
            report(field, f"preferred_batch_size {size} must be positive", line)
        # max_batch_size 0 may still be raised by auto-complete, so only a set limit counts.
        elif 0 < cfg.max_batch_size < size:
            message = f"preferred_batch_size {size} exceeds max_batch_size {cfg.max_batch_size}"
            report(field, message, line)

    levels, default = db.priority_levels, db.default_priority_level
    if default > levels or (levels and default == 0):
        message = (
            f"default_priority_level must be in [1, {levels}], got {default}"
            if levels
            else f"default_priority_level {default} needs priority_levels >= {default}"
        )
        report(
            "dynamic_batching.default_priority_level",
            message,
            find_line(text, "default_priority_level"),
        )
    for level in db.priority_queue_policy:
        if level == 0 or level > levels:
            message = f"priority_queue_policy level {level} is outside [1, {levels}]"
            report(
                "dynamic_batching.priority_queue_policy",
                message,
                find_line(text, "priority_queue_policy"),
            )
    if db.preserve_ordering and levels > 1:
        message = "preserve_ordering allows only one priority level"
        report("dynamic_batching.preserve_ordering", message, find_line(text, "preserve_ordering"))


_BATCH_INPUT_TYPES = ("TYPE_INT32", "TYPE_INT64", "TYPE_FP32")


def _check_ragged(cfg: ModelConfig, text: str | None, report: Report) -> None:
    """allow_ragged_batch, batch_input, batch_output (kiln/scheduling/ragged.py)."""
    ragged = [i.name for i in cfg.input if i.allow_ragged_batch]
    if not (ragged or cfg.batch_input or cfg.batch_output):
        return
    inputs = {i.name for i in cfg.input}
    outputs = {o.name for o in cfg.output}
    if cfg.HasField("sequence_batching"):
        report(
            "sequence_batching",
            "ragged batching (allow_ragged_batch, batch_input, batch_output) works with "
            "dynamic_batching or no scheduler, not with sequence_batching",
            find_line(text, "sequence_batching", top_level=True),
        )
    for name in ragged:
        if cfg.max_batch_size == 0:
            report(
                "input.allow_ragged_batch",
                f'input "{name}": allow_ragged_batch needs max_batch_size > 0 (requests of '
                "different shapes share a batch)",
                find_line(text, "allow_ragged_batch"),
            )
    for i, b in enumerate(cfg.batch_input):
        field = f"batch_input[{i}]"
        line = find_line(text, "batch_input", top_level=True)
        if not b.target_name:
            report(f"{field}.target_name", f"{field} must specify target_name", line)
        type_name = PbDataType.Name(b.data_type)
        if type_name not in _BATCH_INPUT_TYPES:
            report(
                f"{field}.data_type",
                f"{field} data_type must be one of {', '.join(_BATCH_INPUT_TYPES)}, got "
                f"{type_name}",
                line,
            )
        _check_source(field, list(b.source_input), inputs, line, report)
    for i, o in enumerate(cfg.batch_output):
        field = f"batch_output[{i}]"
        line = find_line(text, "batch_output", top_level=True)
        if not o.target_name:
            report(f"{field}.target_name", f"{field} must specify target_name", line)
        for target in o.target_name:
            if outputs and target not in outputs:
                report(
                    f"{field}.target_name",
                    f'{field} target_name "{target}" is not an output of the model',
                    line,
                )
        _check_source(field, list(o.source_input), inputs, line, report)


def _check_source(
    field: str, sources: list[str], inputs: set[str], line: int | None, report: Report
) -> None:
    """A batch input's or output's ``source_input``: exactly one input of the model (once
    the config lists its inputs)."""
    if len(sources) != 1:
        message = f"{field} must name exactly one source_input, got {len(sources)}"
        report(f"{field}.source_input", message, line)
    elif inputs and sources[0] not in inputs:
        message = f'{field} source_input "{sources[0]}" is not an input of the model'
        report(f"{field}.source_input", message, line)


def _check_sequence_batching(cfg: ModelConfig, text: str | None, report: Report) -> None:
    sb = cfg.sequence_batching
    for i, control_input in enumerate(sb.control_input):
        line = find_line(text, "name", control_input.name) or find_line(text, "control_input")
        for j, control in enumerate(control_input.control):
            for name in _BOOL_CONTROLS:
                values = getattr(control, name)
                if values and len(values) != 2:
                    field = f"sequence_batching.control_input[{i}].control[{j}].{name}"
                    report(
                        field,
                        f"{name} needs exactly 2 entries (false, true), got {len(values)}",
                        line,
                    )
    if sb.HasField("oldest"):
        line = find_line(text, "oldest")
        for size in sb.oldest.preferred_batch_size:
            if size <= 0 or 0 < cfg.max_batch_size < size:
                message = f"sequence_batching oldest preferred_batch_size {size} is out of range"
                report("sequence_batching.oldest.preferred_batch_size", message, line)
    if sb.HasField("direct") and not 0.0 <= sb.direct.minimum_slot_utilization <= 1.0:
        message = "minimum_slot_utilization must be in [0, 1]"
        report(
            "sequence_batching.direct.minimum_slot_utilization", message, find_line(text, "direct")
        )

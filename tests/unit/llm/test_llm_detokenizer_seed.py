"""The incremental detokenizer starts from the prompt's last tokens (vLLM's
``convert_prompt_ids_to_tokens``): an output decoded in its prompt's context, so a
SentencePiece (Metaspace) token keeps the leading space it has after other text."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from kiln.llm.tokenizer import SEED_TOKENS, IncrementalDetokenizer, Tokenizer, seed_window
from tests.llm_models import build_metaspace_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("metaspace")
    build_metaspace_tokenizer(folder)
    return Tokenizer(folder)


def test_an_output_keeps_the_space_its_prompt_gives_it(tok: Tokenizer) -> None:
    ids = tok.encode("the quick brown fox jumps")
    prompt, output = ids[:2], ids[2:]
    context = tok.decode(ids)[len(tok.decode(prompt)) :]
    assert context.startswith(" ") and tok.decode(output) == context[1:]
    seeded = IncrementalDetokenizer(tok, True, prompt)
    assert "".join(seeded.add([t]) for t in output) == context
    assert IncrementalDetokenizer(tok, True, prompt).add(output, final=True) == context
    # no prompt: the output decoded alone (vLLM's fallback when none is known)
    assert IncrementalDetokenizer(tok).add(output, final=True) == context[1:]


def test_the_seed_is_the_prompts_last_tokens() -> None:
    window, prefix, read = seed_window(list(range(100)))
    assert window == list(range(100 - SEED_TOKENS, 100)) and read == SEED_TOKENS
    assert prefix == SEED_TOKENS - 5
    assert seed_window([3]) == ([3], 0, 1) and seed_window([]) == ([], 0, 0)

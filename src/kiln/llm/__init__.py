"""kiln's LLM engine: continuous batching over a paged KV cache (see docs/llm.md).

``from kiln.llm import LLM, SamplingParams``: vLLM's offline API (kiln.llm.offline), loaded
on first use (it imports torch; the OpenAI frontend reads this package without it)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("LLM", "SamplingParams", "BeamSearchParams"):
        from kiln.llm import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'kiln.llm' has no attribute '{name}'")

"""kiln's LLM engine: continuous batching over a paged KV cache (see docs/llm.md)."""

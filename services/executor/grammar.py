"""Structured output: compiles constraints with xgrammar and makes per-sequence matchers.

Compiled grammars are cached by xgrammar's compiler (keyed by the schema or pattern), so a
schema that many requests share is compiled once. The matcher of a sequence advances with the
tokens the executor sees it generate, and fills that sequence's row of the step's bitmask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared.structured import choice_ebnf

_ANY_OBJECT = '{"type": "object"}'


class GrammarCompiler:
    """One per executor, built on the first structured request (it loads the tokenizer)."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size

    def matcher(self, guided: tuple[str, str]) -> Any:
        import xgrammar

        kind, spec = guided
        if kind == "json_object":
            # OpenAI's JSON mode means an object; xgrammar's built-in grammar allows any value.
            compiled = self._compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False)
        elif kind == "json_schema":
            # Compact separators: a model cannot ramble in whitespace it is not allowed.
            compiled = self._compiler.compile_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            compiled = self._compiler.compile_regex(spec)
        elif kind == "choice":
            compiled = self._compiler.compile_grammar(choice_ebnf(spec))
        else:
            compiled = self._compiler.compile_grammar(spec)
        return xgrammar.GrammarMatcher(compiled)

    def bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        import xgrammar

        return xgrammar.allocate_token_bitmask(num_rows, self.vocab_size)

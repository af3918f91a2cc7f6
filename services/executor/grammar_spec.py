"""How each structured-output kind compiles with xgrammar; imports no torch, so that the compile
worker (grammar_worker.py), which restarts after every kill, starts in a fraction of a second."""

from __future__ import annotations

from typing import Any

from shared.structured import choice_ebnf

_ANY_OBJECT = '{"type": "object"}'
Guided = tuple[str, str]  # (kind, spec)


def compile_guided(compiler: Any, kind: str, spec: str) -> Any:
    """The CompiledGrammar of a constraint; raises what xgrammar raises for a bad spec."""
    if kind == "json_object":
        # OpenAI's JSON mode means an object; xgrammar's built-in grammar allows any value.
        return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False)
    if kind == "json_schema":
        # Compact separators: a model cannot ramble in whitespace it is not allowed.
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(spec))
    return compiler.compile_grammar(spec)

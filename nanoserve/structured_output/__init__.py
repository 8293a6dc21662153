"""Structured outputs on llguidance: a request's constraint (JSON schema, regex, choice, grammar)
becomes a grammar, a per-request matcher and, each step, a token bitmask applied to the logits.

The frontend uses `validate` (a bad spec is a ValueError at request time); the engine core uses
`GrammarCompiler` (compiled grammars cached per spec, matchers built off the step loop, bitmasks filled
while the model runs) and the sampler `apply_bitmask`.
"""

from nanoserve.structured_output.bitmask import apply_bitmask
from nanoserve.structured_output.compiler import GrammarCompiler
from nanoserve.structured_output.grammar import grammar_text, validate
from nanoserve.structured_output.matcher import GrammarMatcher

__all__ = ["GrammarCompiler", "GrammarMatcher", "apply_bitmask", "grammar_text", "validate"]

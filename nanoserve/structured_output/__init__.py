"""Structured outputs on llguidance: a request's constraint (JSON schema, regex, choice, grammar)
becomes a grammar, a per-request matcher and, each step, a token bitmask applied to the logits.

The frontend uses `validate` (a bad spec is a ValueError at request time), exported here; the engine
core imports `compiler.GrammarCompiler` (compiled grammars cached per spec, matchers built off the step
loop, bitmasks filled while the model runs), `matcher.GrammarMatcher` and the sampler
`bitmask.apply_bitmask` from their modules, which import torch: the frontend never does.
"""

from nanoserve.structured_output.grammar import grammar_text, validate

__all__ = ["grammar_text", "validate"]

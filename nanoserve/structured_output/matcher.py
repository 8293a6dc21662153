"""GrammarMatcher: one request's position in its grammar."""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    """Advanced by each sampled token. `is_terminated` once the grammar is complete and nothing may
    follow (the request then stops); llguidance can also roll tokens back, for speculative decoding."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and an error state) when the grammar forbids it."""
        return self.matcher.consume_token(token_id)

    def accept_all(self, token_ids: list[int]) -> bool:
        return not token_ids or self.matcher.consume_tokens(token_ids)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

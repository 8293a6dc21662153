"""Prompt lookup: draft tokens for a sequence from its own earlier text (vLLM's n-gram proposer).

The draft is the run of tokens that followed the latest earlier occurrence of the sequence's last n
tokens, trying the longest n first. Summaries, code edits, extraction and JSON that quotes its input
copy long spans of the prompt, so the copied span's next tokens are often exactly what the model says.

Each sequence keeps an index from n-gram to where it last occurred, extended by the tokens added since
the previous lookup: O(prompt_lookup_max - prompt_lookup_min + 1) per token, rather than a scan of the
whole context every step. Keys are hashes of the n-grams; a collision only costs a rejected draft.
"""

from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams -> the position just after their latest occurrence before the last token."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.follower: dict[int, int] = {}
        self.num_indexed = 0
        """n-grams ending before this position are in the index."""

    def _extend(self, tokens: list[int]) -> None:
        # The n-grams ending at the last token are left out, so that a lookup of the sequence's suffix
        # finds an earlier occurrence, never itself.
        for end in range(self.num_indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.follower[hash(tuple(tokens[end - n + 1 : end + 1]))] = end + 1
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens to follow `tokens` (which only ever grow), or [] when the last
        n-gram occurred nowhere before."""
        self._extend(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.follower.get(hash(tuple(tokens[-n:])))
            if start is not None:
                return tokens[start : start + max_tokens]
        return []

"""Incremental detokenization of one sample, with stop strings.

Text is produced by `tokenizers`' `DecodeStream`, which buffers byte-fallback and partial UTF-8 tokens
until they form whole characters, so no delta ever ends in half an emoji or CJK character. Stop strings
are matched on the decoded text (they may span tokens); while a sample streams, the last
`len(longest stop) - 1` characters are held back so that a partial stop string is never shown.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from nanoserve.sampling_params import SamplingParams

NUM_PROMPT_CONTEXT_TOKENS = 6
"""Prompt tokens fed to the stream before generation so the first generated token decodes in context
(e.g. keeps the leading space a SentencePiece decoder would strip at the start of text)."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no fast (Rust) backend; nanoserve needs one.")
        self._backend = backend
        self._stream = DecodeStream(
            ids=prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:], skip_special_tokens=params.skip_special_tokens
        )
        self.stop = params.stop or []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.token_ids: list[int] = []
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> tuple[int, str | None]:
        """Decode new tokens; return (tokens consumed, stop string hit or None).

        On a stop-string hit the remaining tokens of this step are not consumed, and the text is cut
        just before the stop string (or just after it with include_stop_str_in_output).
        """
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            chunk = self._stream.step(self._backend, token_id)
            if not chunk:
                continue
            self.output_text += chunk
            if len(self.token_ids) > self.min_tokens:
                stop = self._find_stop(len(chunk))
                if stop is not None:
                    return i + 1, stop
        return len(new_token_ids), None

    def _find_stop(self, num_new_chars: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # only the new characters and the len(stop) - 1 before them can complete a new match
            start = max(0, len(self.output_text) - num_new_chars - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: all of it once finished, else without the held-back tail."""
        if finished or not self.stop_buffer_length:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.stop_buffer_length)]

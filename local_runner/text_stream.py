"""Generated ids -> text deltas, with stop strings matched across token boundaries.

Text is held back while it could still be the start of a stop string (or an incomplete UTF-8
character), so a client never sees text that the stop string later takes back.

Decoding is incremental (vLLM's detokenizer offsets): each token decodes a short window of the latest
ids, never the whole answer, so a token costs the same at the 1,000th as at the first (decoding every
id again each token made a long answer's streaming quadratic, on the runner's thread).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]):
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._text = ""  # the decoded text of ids[:read_offset]
        # ids[prefix_offset:read_offset] are decoded again with each new token: the context a tokenizer
        # needs to decode the next ids as it would within the whole sequence (leading spaces, merges).
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0  # characters of the decoded text already sent
        self.stopped = False
        self.stop_sequence: str | None = None  # the stop string that ended the text, once one has

    @property
    def text(self) -> str:
        """The text decoded so far (complete characters only)."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def _advance(self, final: bool = False) -> None:
        """Decode the ids past read_offset if they end on a whole character (`final`: whatever they are,
        an incomplete character's bytes as the replacement character, as a full decode gives them)."""
        if self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if final or (len(window) > len(prefix) and not window.endswith("\ufffd")):
            self._text += window[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that is now safe to send ('' if none). Sets `stopped` on a stop."""
        self._ids.append(token_id)
        self._advance()
        text = self._text
        for stop in self._stop:
            # Only a match that ends in the unsent tail can be new.
            at = text.find(stop, max(0, self._emitted - len(stop) + 1))
            if at != -1:
                self.stopped, self.stop_sequence = True, stop
                return self._take(text, at)
        # An incomplete character never reaches the text (_advance waits for its other bytes).
        return self._take(text, len(text) - self._holdback)

    def finish(self) -> str:
        """The held-back rest, at the end of generation."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._take(self._text, len(self._text))

    def _take(self, text: str, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = text[self._emitted : end]
        self._emitted = end
        return delta

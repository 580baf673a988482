"""Generated ids -> text deltas, with stop strings matched across token boundaries.

Text is held back while it could still be the start of a stop string (or an incomplete UTF-8
character), so a client never sees text that the stop string later takes back.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]):
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already sent
        self.stopped = False

    @property
    def text(self) -> str:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that is now safe to send ('' if none). Sets `stopped` on a stop."""
        self._ids.append(token_id)
        text = self.text
        for stop in self._stop:
            # Only a match that ends in the unsent tail can be new.
            at = text.find(stop, max(0, self._emitted - len(stop) + 1))
            if at != -1:
                self.stopped = True
                return self._take(text, at)
        safe = len(text) - self._holdback
        while safe > self._emitted and text[safe - 1] == "\ufffd":
            safe -= 1  # part of a multi-byte character whose other bytes are still to come
        return self._take(text, safe)

    def finish(self) -> str:
        """The held-back rest, at the end of generation."""
        return "" if self.stopped else self._take(self.text, len(self.text))

    def _take(self, text: str, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = text[self._emitted : end]
        self._emitted = end
        return delta

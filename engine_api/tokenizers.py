"""One tokenizer per thread, for every engine's models."""

from __future__ import annotations

import copy
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ThreadTokenizers:
    """One tokenizer per thread: a fast (Rust) tokenizer used from two threads at once fails with
    "Already borrowed", and the proxy renders prompts on executor threads while an engine's thread
    decodes answers. Copies are made on first use in each thread (a deep copy of the original)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._origin = tokenizer
        self._lock = threading.Lock()
        self._local = threading.local()

    def get(self) -> PreTrainedTokenizerBase:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._lock:  # copying reads the original: never while another thread copies it
                tok = copy.deepcopy(self._origin)
            self._local.tokenizer = tok
        return tok

"""Constrained decoding's grammars, compiled per model (xgrammar): the serving layer gives a grammar as
xgrammar EBNF text (`SamplingParams.grammar`); this compiles it for the model's tokenizer, once per
distinct grammar (xgrammar's compiler caches), off the worker thread.

The compiler is built on first use: its tokenizer table is paid for per model, and never by a server that
never constrains an answer.
"""

from __future__ import annotations

import threading
from typing import Any

from .loader import LoadedModel


class Grammars:
    def __init__(self, lm: LoadedModel) -> None:
        self._lm = lm
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._lm.tokenizer,
                    vocab_size=self._lm.model.config.vocab_size,  # the logits' width (may pad the vocab)
                    stop_token_ids=sorted(self._lm.eos_token_ids),
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, ebnf: str) -> Any:
        """The grammar compiled for this model (an xgrammar CompiledGrammar). Blocking: call it off the
        event loop."""
        return self._get_compiler().compile_grammar(ebnf)

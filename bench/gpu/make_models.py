"""Random-weight Llama models in HF folders (safetensors), built on the device, with a tokenizer made in
code: the real loading code runs, and nothing is downloaded or carried.

    python -m bench.gpu.make_models ROOT [--device cuda] [--models m135,m8b] [--tokenizer DIR]

m135: SmolLM2-135M's shape; m8b: Llama-3.1-8B's (32 layers, 4096 wide, 8 K/V heads of 128). The
tokenizer is a word-level one over a vocabulary the size of the model's (the words bench/gpu/drive.py
writes, then fillers), so a word is one token and a decoded answer re-encodes to the same ids; a
ChatML template renders the chat. `--tokenizer DIR` copies another instead (SmolLM2's, say). Random
weights make the answers meaningless but not the arithmetic: timings are those of the real shapes, and
equal logprobs are as strict a test as with trained weights.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.gpu.words import WORDS

VOCAB = 49152
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with a space after every special token: the pre-tokenizer splits on whitespace only.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|> ' + message['role'] + ' ' + message['content'] + "
    "' <|im_end|> ' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}"
)
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
    rms_norm_eps=1e-5,
)
SHAPES = {
    "m135": SMOLLM2,
    "m8b": {
        **SMOLLM2,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    },
}


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of VOCAB ids: the specials, the drive's words, then fillers w<i>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [w for w in dict.fromkeys(["system", "user", "assistant", "tool", *WORDS])]
    vocab = {w: i for i, w in enumerate(words)}
    for i in range(len(vocab), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="m135,m8b")
    ap.add_argument("--tokenizer", type=Path, default=None)
    a = ap.parse_args()
    for name in a.models.split(","):
        started = time.time()
        cfg = LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2, **SHAPES[name])
        torch.manual_seed(0)
        with torch.device(a.device):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        out = a.root / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
        if a.tokenizer is not None:
            for f in a.tokenizer.iterdir():
                shutil.copy(f, out / f.name)
        else:
            write_tokenizer(out)
        n = sum(p.numel() for p in model.parameters())
        del model
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"{name}: {n / 1e9:.2f} B parameters in {time.time() - started:.1f} s at {out}", flush=True)


if __name__ == "__main__":
    main()

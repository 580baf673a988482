"""Drive a running attnstore: reuse vs recompute (answers and TTFT), batched vs alone, tiers, decode speed.
Client-side TTFT = request sent -> first streamed content chunk. Writes JSON lines to --out.

The reference check's client (the project's shared GPU check), kept as it is so figures compare; the
words come from bench/gpu/words.py (one token each in make_models.py's tokenizer)."""

import argparse
import asyncio
import json
import random
import time

import aiohttp

from bench.gpu.words import WORDS


def text(n_words, seed):
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(n_words))


class Driver:
    def __init__(self, base, model, out):
        self.base, self.model, self.out = base.rstrip("/"), model, open(out, "a")  # noqa: SIM115 - the run's log

    def log(self, **rec):
        rec["t"] = round(time.time(), 3)
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()
        print(json.dumps(rec)[:400], flush=True)

    async def chat(self, s, messages, session, max_tokens=16, timeout=300, key="main"):
        body = {
            "model": self.model,
            "messages": messages,
            "session_id": session,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 1,
        }
        t0 = time.perf_counter()
        ttft = None
        parts = []
        usage = None
        lps = []
        async with s.post(
            self.base + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            h = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-attentionstore")}
            if r.status != 200:
                return {"status": r.status, "error": (await r.text())[:300], "headers": h}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                if ev.get("usage"):
                    usage = ev["usage"]
                for c in ev.get("choices", []):
                    for lp in (c.get("logprobs") or {}).get("content") or []:
                        lps.append(lp.get("logprob"))
                    d = c.get("delta", {}).get("content")
                    if d:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(d)
        total = time.perf_counter() - t0
        return {
            "status": 200,
            "ttft_s": ttft,
            "total_s": total,
            "text": "".join(parts),
            "usage": usage,
            "lps": lps,
            "cache": h.get("x-attentionstore-cache"),
            "tiers": h.get("x-attentionstore-tiers"),
            "reused": h.get("x-attentionstore-reused-tokens"),
            "server_ttft_ms": h.get("x-attentionstore-ttft-ms"),
        }


async def wait_ready(base, limit=600):
    t0 = time.time()
    async with aiohttp.ClientSession() as s:
        while time.time() - t0 < limit:
            try:
                async with s.get(base + "/healthz", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return await r.json(), time.time() - t0
            except Exception:
                pass
            await asyncio.sleep(1)
    return None, time.time() - t0


def same(a, b):
    """(equal text and logprobs bit for bit, largest logprob difference)"""
    la, lb = a.get("lps") or [], b.get("lps") or []
    diff = max((abs(x - y) for x, y in zip(la, lb, strict=False)), default=None) if la and lb else None
    return a.get("text") == b.get("text") and la == lb and len(la) > 0, diff


def short(r):
    return {
        k: r.get(k)
        for k in ("status", "ttft_s", "total_s", "cache", "tiers", "reused", "server_ttft_ms", "error")
    }


async def correctness(d, s, words, n_conv):
    """Reuse == recompute and batched == alone, greedy; tiers by small capacities (settings)."""
    convs = {}
    for i in range(n_conv):  # turn 1 of every conversation, one at a time
        msgs = [{"role": "user", "content": text(words, 100 + i)}]
        r = await d.chat(s, msgs, f"c{i}", 24)
        d.log(phase="correct", step="turn1", conv=i, **short(r))
        convs[i] = msgs + [
            {"role": "assistant", "content": r.get("text", "")},
            {"role": "user", "content": text(30, 900 + i)},
        ]
    n_same = 0
    for i in range(n_conv):  # turn 2 (reused from whatever tier it now sits in), then a recompute
        a = await d.chat(s, convs[i], f"c{i}", 24)
        b = await d.chat(s, convs[i], f"c{i}", 24, key=f"rc{i}")
        eq, diff = same(a, b)
        n_same += eq
        d.log(
            phase="correct",
            step="turn2",
            conv=i,
            reuse=short(a),
            recompute=short(b),
            equal=eq,
            max_lp_diff=diff,
            a=a.get("text", "")[:80],
            b=b.get("text", "")[:80],
        )
    d.log(phase="correct", step="summary-reuse", equal=n_same, of=n_conv)
    # batched vs alone: 8 distinct prompts of different lengths at once, then each alone
    prompts = [[{"role": "user", "content": text(20 + 37 * k, 500 + k)}] for k in range(8)]
    together = await asyncio.gather(*(d.chat(s, p, f"b{k}", 32) for k, p in enumerate(prompts)))
    alone = [await d.chat(s, p, f"b{k}", 32, key=f"al{k}") for k, p in enumerate(prompts)]
    res = [same(x, y) for x, y in zip(together, alone, strict=True)]
    d.log(
        phase="correct",
        step="summary-batch",
        equal=sum(e for e, _ in res),
        of=8,
        max_lp_diffs=[df for _, df in res],
        caches=[x.get("cache") for x in alone],
    )


async def perf(d, s, lengths, streams, decode_tokens):
    rows = []
    for idx, L in enumerate(lengths):  # words ~ tokens for this vocabulary (measured: usage.prompt_tokens)
        msgs = [{"role": "user", "content": text(L, L)}]
        t1 = await d.chat(s, msgs, f"p{L}", 8)
        msgs2 = msgs + [
            {"role": "assistant", "content": t1.get("text", "")},
            {"role": "user", "content": text(40, L + 1)},
        ]
        hit = await d.chat(s, msgs2, f"p{L}", 8)
        rec = await d.chat(s, msgs2, f"p{L}", 8, key=f"rp{idx}")
        eq, diff = same(hit, rec)
        row = dict(
            words=L,
            prompt_tokens=(rec.get("usage") or {}).get("prompt_tokens"),
            miss_turn1=short(t1),
            hit=short(hit),
            recompute=short(rec),
            equal=eq,
            max_lp_diff=diff,
        )
        if hit.get("ttft_s") and rec.get("ttft_s"):
            row["ratio"] = round(hit["ttft_s"] / rec["ttft_s"], 3)
        d.log(phase="perf", step="ttft", **row)
        rows.append(row)
    for L in lengths:  # a third turn later: earlier sessions were pushed down the tiers by later ones
        msgs = [{"role": "user", "content": text(L, L)}]
        r = await d.chat(
            s,
            msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(40, L + 7)}],
            f"p{L}",
            8,
        )
        d.log(phase="perf", step="ttft-later", words=L, **short(r))
    for n in streams:
        prompts = [[{"role": "user", "content": text(100, 7000 + 100 * n + k)}] for k in range(n)]
        t0 = time.perf_counter()
        res = await asyncio.gather(*(d.chat(s, p, f"s{n}-{k}", decode_tokens) for k, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        toks = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in res)
        d.log(
            phase="perf",
            step="streams",
            n=n,
            tokens=toks,
            wall_s=round(wall, 2),
            tok_s=round(toks / wall, 1),
            per_stream_tok_s=round(toks / wall / n, 1),
            failed=sum(r.get("status") != 200 for r in res),
        )


def summarize(path):
    for line in open(path):  # noqa: SIM115 - read once, at exit
        r = json.loads(line)
        if r["step"] == "ttft":
            print(
                "ttft",
                r["words"],
                "words",
                r["prompt_tokens"],
                "tokens | miss",
                r["miss_turn1"]["ttft_s"],
                "| hit",
                r["hit"]["ttft_s"],
                r["hit"]["cache"],
                r["hit"]["tiers"],
                "| recompute",
                r["recompute"]["ttft_s"],
                "| ratio",
                r.get("ratio"),
                "| equal",
                r["equal"],
                r["max_lp_diff"],
            )
        elif r["step"] in ("ttft-later", "streams"):
            print(json.dumps(r)[:400])


async def main():
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        return summarize(sys.argv[2])
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["correct", "perf"], required=True)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--convs", type=int, default=6)
    ap.add_argument("--lengths", default="1000,4000,8000,16000,30000")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--decode", type=int, default=128)
    a = ap.parse_args()
    d = Driver(a.base, a.model, a.out)
    health, waited = await wait_ready(a.base)
    d.log(phase=a.phase, step="healthz", waited_s=round(waited, 1), health=health)
    if health is None:
        return
    async with aiohttp.ClientSession() as s:
        if a.phase == "correct":
            await correctness(d, s, a.words, a.convs)
        else:
            await perf(
                d, s, [int(x) for x in a.lengths.split(",")], [int(x) for x in a.streams.split(",")], a.decode
            )
        async with s.get(
            a.base + "/v1/attention_store/stats", headers={"Authorization": "Bearer admin"}
        ) as r:
            d.log(phase=a.phase, step="stats", stats=await r.json())


asyncio.run(main())

"""settings.json for the GPU check's servers: python -m bench.gpu.settings correct|perf MODEL_DIR NAME L2_DIR

API keys per tenant, so a recompute (another tenant) never reuses. Environment: BI (1: batch_invariant
true, 0: false, unset: the default), MAXRUN (max_running, perf; default 32), L0MB / L1MB (the tiers,
perf), DEVICE (auto), PORT (8081)."""

import json
import os
import sys

phase, model, name, l2 = sys.argv[1:5]
tiers = {"correct": (12, 24, 1024), "perf": (2048, 4096, 65536)}[phase]
settings = {
    "attention_store": {
        "enabled": True,
        "session_key": "session_id",
        "tiering": {
            "l0_gpu": {"capacity_mb": int(os.environ.get("L0MB", tiers[0])), "eviction": "lru"},
            "l1_host": {"capacity_mb": int(os.environ.get("L1MB", tiers[1])), "eviction": "lru"},
            "l2_disk": {"path": l2, "capacity_mb": tiers[2], "format": "safetensors"},
        },
        "preload": {"enabled": True, "lookahead_turns": 1, "async_save": True, "overlap_with_compute": True},
        "scheduler_aware": {"enabled": True, "placement_hint": "ttft_priority", "evict_on_pressure": True},
        "position_encoding": {
            "decouple": True,
            "truncate_on_overflow": True,
            "max_context_tokens": 32768 if phase == "perf" else 8192,
        },
    },
    "llm_endpoint": {"base_url": "", "api_key_env": "ATTNSTORE_UPSTREAM_API_KEY", "model": ""},
    "local_runner": {
        "enabled": True,
        "device": os.environ.get("DEVICE", "auto"),
        "dtype": "auto",
        "models": {name: model},
        "max_queue": 64,
        "cache_dir": "/tmp/attn-models",
    },
    "proxy": {
        "host": "127.0.0.1",
        "port": int(os.environ.get("PORT", 8081)),
        "session_index": "memory",
        "replica_id": "",
        "api_keys": ["main"]
        + [f"rc{i}" for i in range(64)]
        + [f"al{i}" for i in range(8)]
        + [f"rp{i}" for i in range(16)],
        "admin_keys": ["admin"],
    },
}
if phase == "perf":
    settings["local_runner"].update(max_running=int(os.environ.get("MAXRUN", 32)), max_batch_tokens=8192)
if os.environ.get("BI") in ("0", "1"):
    settings["local_runner"]["batch_invariant"] = os.environ["BI"] == "1"
print(json.dumps(settings, indent=1))

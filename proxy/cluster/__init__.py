"""Replicas together: the session index (memory or Redis) and KV-aware forwarding between them."""

"""Local serving: the chat backend that runs turns on the local runner (`proxy.backend.LocalBackend`), its
admission, the options it serves, and the builder that assembles models, KV stores, runner and backend
from settings.

Imported only when `local_runner.enabled` (it pulls in torch and transformers)."""

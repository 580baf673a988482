"""The embedded engine's side of local serving: the adapter that runs turns on `local_runner`
(`engine.EmbeddedEngine`) and the builder that assembles models, KV stores, runner and the serving layer
from settings.

Imported only when `local_runner.enabled` (it pulls in torch and transformers)."""

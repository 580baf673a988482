"""The HTTP surface, the roof of the proxy: the aiohttp app, its middleware and routes, the body and bind
limits, and the log."""

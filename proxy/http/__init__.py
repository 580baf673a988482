"""The HTTP surface: the aiohttp app, its keys, middleware, routes, limits, errors, metrics and log."""

"""Servers and helpers shared by the benchmarks and the tests: the threaded app server, the fake OpenAI
upstream, replica and HAProxy processes, a throw-away Redis, polling waits.

It ships with the project (inside `bench`), so an installed `attnstore bench` runs outside the checkout;
`tests/support/` re-exports it for the tests. None of it is product code: `proxy/`, `kvtier/` and
`local_runner/` never import it."""

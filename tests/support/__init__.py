"""The tests' servers and helpers: re-exported from `bench.support`, where they live so that an installed
`attnstore bench` has them outside the checkout. Import from either; the objects are the same."""

"""gqakit's own model classes, for grouped-K/V forms no stock transformers class holds (registered by
`registry.install()` when gqakit is imported)."""

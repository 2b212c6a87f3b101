"""Built-in KV block allocators, one per module; each registers itself by name on import."""

"""Built-in proposers for speculative decoding, one per module; each registers itself by name on import."""

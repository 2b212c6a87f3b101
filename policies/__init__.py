"""Built-in scheduling policies, one per module; each registers itself by name on import."""

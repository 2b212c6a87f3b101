"""Built-in speculation policies (how many tokens to propose per request and step), one per module; each
registers itself by name on import."""

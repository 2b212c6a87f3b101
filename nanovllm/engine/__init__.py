"""The engine: scheduler mechanics, model runner, KV cache, and the step loop that ties them together."""

"""The built-in routers, one per module; each registers itself with ``@register_router`` (``router=NAME``).
They use only nano-vllm's public interfaces, as a user's router would."""

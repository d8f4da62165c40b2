"""asyncrl: an asynchronous actor-system runtime for RL post-training of LLMs."""

from typing import Any

__all__ = ["Runtime"]


def __getattr__(name: str) -> Any:  # lazy: `import asyncrl` stays free of torch/transformers imports
    if name == "Runtime":
        from asyncrl.runtime import Runtime

        return Runtime
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")

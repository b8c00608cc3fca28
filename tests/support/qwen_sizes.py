"""Qwen2.5-VL's released text sizes, as `model.configOverrides` over the shared 3B config.

The vision tower stays the 3B's, its output widened to the decoder's hidden size; the vocabulary
is the released 152,064 with an untied LM head. One table for the planner's tests and its table.
"""

from __future__ import annotations

from typing import Any

# hidden, intermediate, layers, attention heads, KV heads
RELEASED = {
    "7B": (3584, 18944, 28, 28, 4),
    "32B": (5120, 27648, 64, 40, 8),
    "72B": (8192, 29568, 80, 64, 8),
}


def released_overrides(size: str) -> dict[str, Any]:
    """The config.json keys that turn the shared 3B config into the released `size` ("7B", ...)."""
    hidden, inter, layers, heads, kv = RELEASED[size]
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "vision_config": {"out_hidden_size": hidden},
    }

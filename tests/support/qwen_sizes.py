"""Released model sizes as `model.configOverrides` over a shared config: Qwen2.5-VL over the 3B
config, InternVL3.5 and LLaVA-OneVision-1.5 over their 8B configs.

Qwen2.5-VL's vision tower stays the 3B's, its output widened to the decoder's hidden size; the vocabulary
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


# InternVL3.5 (the `-HF` releases) as `model.configOverrides` over the shared InternVL3.5-8B config:
# InternViT-300M (the shared config's) or InternViT-6B, and a Qwen3 decoder of the size's own.
# text: hidden, intermediate, layers, attention heads, KV heads (head_dim 128, vocabulary 151,936). Every
# size has its own LM head: the published totals (1.06B, 2.35B, 4.73B) are the untied counts (tied, the
# small three would be 0.91B, 2.04B and 4.34B), though Qwen3-0.6B to 4B tie theirs.
INTERNVL35_TEXT = {
    "1B": (1024, 3072, 28, 16, 8),  # Qwen3-0.6B
    "2B": (2048, 6144, 28, 16, 8),  # Qwen3-1.7B
    "4B": (2560, 9728, 36, 32, 8),  # Qwen3-4B
    "8B": (4096, 12288, 36, 32, 8),  # Qwen3-8B
    "14B": (5120, 17408, 40, 40, 8),  # Qwen3-14B
    "38B": (5120, 25600, 64, 64, 8),  # Qwen3-32B
}
# InternViT-6B: 45 layers of width 3200 (25 heads, MLP 12800), RMSNorm, qk norm, no q/k/v bias
INTERNVIT_6B = {
    "num_hidden_layers": 45,
    "hidden_size": 3200,
    "num_attention_heads": 25,
    "intermediate_size": 12800,
    "norm_type": "rms_norm",
    "use_qk_norm": True,
    "attention_bias": False,
}
INTERNVL35 = tuple(INTERNVL35_TEXT)


def internvl_overrides(size: str) -> dict[str, Any]:
    """The config.json keys that turn the shared InternVL3.5-8B config into the released `size`
    ("1B" ... "38B"); the head untied explicitly (transformers 5 ties InternVL's unless told)."""
    hidden, inter, layers, heads, kv = INTERNVL35_TEXT[size]
    text = {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "vocab_size": 151936,
        "layer_types": ["full_attention"] * layers,
        "tie_word_embeddings": False,
    }
    vision = INTERNVIT_6B if size == "38B" else {}
    return {"tie_word_embeddings": False, "text_config": text, "vision_config": vision}


# LLaVA-OneVision-1.5 (lmms-lab's `-Instruct` releases) as `model.configOverrides` over the shared 8B
# config: RICE-ViT-L (the shared config's tower, in every size) and a Qwen3 decoder of the size's own.
# text: hidden, intermediate, layers, attention heads, KV heads (head_dim 128, vocabulary 151,936, an
# untied LM head: upstream's text config class default, which the 8B config keeps).
LLAVA_OV15_TEXT = {
    "4B": (2560, 9728, 36, 32, 8),  # Qwen3-4B
    "8B": (4096, 12288, 36, 32, 8),  # Qwen3-8B: the shared config
}
LLAVA_OV15 = tuple(LLAVA_OV15_TEXT)


def llava_ov15_overrides(size: str) -> dict[str, Any]:
    """The config.json keys that turn the shared LLaVA-OneVision-1.5-8B config into the released
    `size` ("4B", "8B"): the decoder's sizes, and the merger's output widened to its hidden size."""
    hidden, inter, layers, heads, kv = LLAVA_OV15_TEXT[size]
    text = {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "vocab_size": 151936,
        "layer_types": ["full_attention"] * layers,
        "max_window_layers": layers,
    }
    return {
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"text_hidden_size": hidden},
    }

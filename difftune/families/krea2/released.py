"""The released Krea 2 model's configurations: the transformer, Qwen3-VL-4B-Instruct (its
language model and vision tower) and the Qwen-Image autoencoder.

Single files record shapes only; what they do not record comes from here, and the meta-device
test builds the real model from these (parameter counts in the README).
"""

from __future__ import annotations

from typing import Any

# The released transformer (Krea2Transformer2DModel's defaults: 28 blocks, 48 heads of 128).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_channels": 64, "num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 48,
    "num_key_value_heads": 12, "intermediate_size": 16384, "timestep_embed_dim": 256,
    "text_hidden_dim": 2560, "num_text_layers": 12, "text_num_attention_heads": 20,
    "text_num_key_value_heads": 20, "text_intermediate_size": 6912,
    "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2,
    "axes_dims_rope": (32, 48, 48), "rope_theta": 1000.0, "norm_eps": 1e-5,
}
# Qwen3-VL-4B-Instruct, the text encoder: its language model and vision tower.
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                        "mrope_section": [24, 20, 20], "mrope_interleaved": True},
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
    "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
}

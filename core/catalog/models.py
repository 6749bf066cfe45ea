"""Model presets: the sizes a study names instead of spelling out its dimensions.

Everything but the position encoding stays fixed across a study (pre-norm blocks, GELU
MLP, tied embeddings; worker/layers.py and worker/model.py), so a preset is only its
three dimensions."""

from __future__ import annotations

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4},
    "small": {"d_model": 128, "n_layers": 4, "n_heads": 4},
    "base": {"d_model": 512, "n_layers": 8, "n_heads": 8},
    "large": {"d_model": 768, "n_layers": 12, "n_heads": 12},
}

# How attention executes (worker.attention): named as HF transformers names them. An
# execution choice like the device: no number changes beyond rounding, no hash either.
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "eager", "sdpa", "flex_attention")

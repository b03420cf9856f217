"""State-dict key maps between the original Wan / CausVid names and the diffusers / transformers ones, each written
once as a forward table of (original regex, target template) and inverted mechanically (`inverted`)."""

from __future__ import annotations

import re


def inverted(rules: list[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    """The inverse of a forward table: each target template becomes a pattern (its \\N replaced by the source's
    N-th group) and each source pattern a template."""
    inverse = []
    for orig, target in rules:
        groups = re.findall(r"\((.*?)\)", orig)
        pat = re.escape(target)
        for i, g in enumerate(groups, start=1):
            pat = pat.replace(re.escape(f"\\{i}"), f"({g})")
        tmpl = orig
        for i, g in enumerate(groups, start=1):
            tmpl = tmpl.replace(f"({g})", f"\\{i}", 1)
        inverse.append((re.compile(pat + "$"), tmpl.replace("\\.", ".")))
    return inverse


# ----------------------------------------------------------------------------------------------------------------
# DiT key mapping, original <-> diffusers (diffusers scripts/convert_wan_to_diffusers.py:31-72; the same table as
# diffusers' convert_wan_transformer_to_diffusers, which the tests cross-check)

_DIT_MAP = [
    (r"text_embedding\.0\.(.+)", r"condition_embedder.text_embedder.linear_1.\1"),
    (r"text_embedding\.2\.(.+)", r"condition_embedder.text_embedder.linear_2.\1"),
    (r"time_embedding\.0\.(.+)", r"condition_embedder.time_embedder.linear_1.\1"),
    (r"time_embedding\.2\.(.+)", r"condition_embedder.time_embedder.linear_2.\1"),
    (r"time_projection\.1\.(.+)", r"condition_embedder.time_proj.\1"),
    (r"blocks\.(\d+)\.self_attn\.q\.(.+)", r"blocks.\1.attn1.to_q.\2"),
    (r"blocks\.(\d+)\.self_attn\.k\.(.+)", r"blocks.\1.attn1.to_k.\2"),
    (r"blocks\.(\d+)\.self_attn\.v\.(.+)", r"blocks.\1.attn1.to_v.\2"),
    (r"blocks\.(\d+)\.self_attn\.o\.(.+)", r"blocks.\1.attn1.to_out.0.\2"),
    (r"blocks\.(\d+)\.self_attn\.norm_(q|k)\.(.+)", r"blocks.\1.attn1.norm_\2.\3"),
    (r"blocks\.(\d+)\.cross_attn\.q\.(.+)", r"blocks.\1.attn2.to_q.\2"),
    (r"blocks\.(\d+)\.cross_attn\.k\.(.+)", r"blocks.\1.attn2.to_k.\2"),
    (r"blocks\.(\d+)\.cross_attn\.v\.(.+)", r"blocks.\1.attn2.to_v.\2"),
    (r"blocks\.(\d+)\.cross_attn\.o\.(.+)", r"blocks.\1.attn2.to_out.0.\2"),
    (r"blocks\.(\d+)\.cross_attn\.norm_(q|k)\.(.+)", r"blocks.\1.attn2.norm_\2.\3"),
    (r"blocks\.(\d+)\.norm3\.(.+)", r"blocks.\1.norm2.\2"),  # the cross-attention pre-norm
    (r"blocks\.(\d+)\.ffn\.0\.(.+)", r"blocks.\1.ffn.net.0.proj.\2"),
    (r"blocks\.(\d+)\.ffn\.2\.(.+)", r"blocks.\1.ffn.net.2.\2"),
    (r"blocks\.(\d+)\.modulation", r"blocks.\1.scale_shift_table"),
    (r"head\.head\.(.+)", r"proj_out.\1"),
    (r"head\.modulation", r"scale_shift_table"),
]
_DIT_FWD = [(re.compile(a + "$"), b) for a, b in _DIT_MAP]
_DIT_INV = inverted(_DIT_MAP)


def dit_key_to_diffusers(key: str) -> str:
    for pat, tmpl in _DIT_FWD:
        if pat.match(key):
            return pat.sub(tmpl, key)
    return key


def dit_key_to_original(key: str) -> str:
    for pat, tmpl in _DIT_INV:
        if pat.match(key):
            return pat.sub(tmpl, key)
    return key


def expected_original_keys(num_layers: int) -> int:
    """Tensor count of a Wan DiT checkpoint: 27 per block + 15 outside (825 for 30 layers; CausVid causal_model.py)."""
    return 27 * num_layers + 15


# ----------------------------------------------------------------------------------------------------------------
# umT5 key mapping, original <-> transformers (the tied `encoder.embed_tokens` copy has no original name)

_T5_MAP = [
    (r"token_embedding\.weight", "shared.weight"),
    (r"blocks\.(\d+)\.norm1\.weight", r"encoder.block.\1.layer.0.layer_norm.weight"),
    (r"blocks\.(\d+)\.attn\.(q|k|v|o)\.weight", r"encoder.block.\1.layer.0.SelfAttention.\2.weight"),
    (r"blocks\.(\d+)\.pos_embedding\.embedding\.weight",
     r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias.weight"),
    (r"blocks\.(\d+)\.norm2\.weight", r"encoder.block.\1.layer.1.layer_norm.weight"),
    (r"blocks\.(\d+)\.ffn\.gate\.0\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wi_0.weight"),
    (r"blocks\.(\d+)\.ffn\.fc1\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wi_1.weight"),
    (r"blocks\.(\d+)\.ffn\.fc2\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wo.weight"),
    (r"norm\.weight", "encoder.final_layer_norm.weight"),
]
_T5_FWD = [(re.compile(a + "$"), b) for a, b in _T5_MAP]


def t5_key_to_transformers(key: str) -> str:
    for pat, tmpl in _T5_FWD:
        if pat.match(key):
            return pat.sub(tmpl, key)
    return key


_T5_INV = inverted(_T5_MAP)


def t5_key_to_original(key: str) -> str | None:
    """The original name of a transformers umT5 key, or None when it has none."""
    for pat, tmpl in _T5_INV:
        if pat.match(key):
            return pat.sub(tmpl, key)
    return None

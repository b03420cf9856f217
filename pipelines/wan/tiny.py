"""Tiny configurations of the real architecture, for tests and the offline demo.

Every code path of the 1.3B model at CPU speed: 2 heads x head_dim 32 (RoPE t/h/w = 12/10/10; a power of two
with head_dim mod 6 = 2, so every codec runs on it, Hadamard rotations and 32-channel value groups included), 2 layers,
a non-square 2x3 token grid (latents 4x6, pixels 32x48), chunk- and frame-wise blocking, a real (small) Wan VAE with
the 1.3B layout (dim_mult [1,2,4,4], 2 res blocks: the original-format converter stays valid), a small umT5 encoder and
a character-level tokenizer built with `tokenizers` (no sentencepiece model to download). Weights are drawn from a
private generator with fan-in scaling so activations are O(1) and the head is not zero (the original zero-inits it,
CausVid causal_model.py:727-749). `kv_sensitive=True` (what `mmkv demo` uses) rescales that init so the output depends
on attention over past frames and KV compression shows (`kv_sensitive_`). `write_tiny_base` writes a base directory in
either layout; `write_causvid_checkpoint`, `write_causal_forcing_checkpoint` and `write_self_forcing_checkpoint` write
the DiT in the three training-checkpoint wrappers (CausVid causvid/train_distillation.py:127-142, Causal Forcing
trainer/distillation.py:188-210; Self-Forcing's `trainer/distillation.py` `save`).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import torch

from mmkv.io import save_pretrained
from mmkv.codecs.base import private_generator
from mmkv.pipelines.wan.keymaps import dit_key_to_original, t5_key_to_original

TINY_DIT: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 128,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 64,
}
TINY_TEXT_LEN = 16
TINY_VAE: dict[str, Any] = {
    "base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True],
}
TINY_T5: dict[str, Any] = {
    "vocab_size": 256, "d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 64, "num_layers": 2,
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
    "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6,
}
# Pixels 33 x 32 x 48 -> latents 9 x 4 x 6 -> 6 tokens per frame (chunk-wise: 3 blocks of 3 frames).
TINY_VIDEO = {"frames": 33, "height": 32, "width": 48}


@torch.no_grad()
def reinit_(module: torch.nn.Module, seed: int, stream: str) -> torch.nn.Module:
    """Deterministic O(1) weights from a private generator: matrices N(0, 1/fan_in), embedding tables N(0, 1),
    modulation tables N(0, 1/dim), norm scales 1 + 0.1 N(0, 1), biases 0.1 N(0, 1)."""
    g = private_generator(seed, "tiny", stream)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if ("norm" in name or leaf == "gamma") and leaf in ("weight", "gamma"):
            p.copy_(1 + 0.1 * noise)
        elif p.dim() < 2:
            p.copy_(0.1 * noise)
        elif "scale_shift_table" in name:
            p.copy_(noise / p.shape[-1] ** 0.5)
        elif name in ("shared.weight", "encoder.embed_tokens.weight") or "relative_attention_bias" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p[0].numel() ** 0.5)
    return module


# Gains of `kv_sensitive_`, chosen by measurement (docs/perf.md, "The tiny DiT that reads its cache"). Full `mmkv demo`,
# per-codec mean PSNR over 4 prompts: 2-bit caches 25-29 dB and 4-bit 34-42 dB, against 43-47 / 54-58 dB with the plain
# init.
KV_SENSITIVE_GAINS: dict[str, float] = {"qk": 2.0, "self_attn_out": 3.0, "cross_attn_out": 0.5, "ffn_out": 0.5}


@torch.no_grad()
def kv_sensitive_(transformer: torch.nn.Module, gains: dict[str, float] | None = None) -> torch.nn.Module:
    """Rescale a `reinit_`-ed Wan DiT so its output depends on the self-attention over past frames.

    With the plain init a 2-bit cache moves the latents by ~2e-4 in cosine (~46 dB PSNR): the residual stream is
    carried by the patch embedding, the text cross-attention and the FFN, and near-uniform attention averages the
    codec's error away. Per block, in place (same modules, same keys, so the release-format checkpoints and loaders
    are unchanged):
    * `attn1.norm_q/norm_k` weights x `qk`: the RMS-normed q.k/sqrt(d) logits have std ~0.95 at init (largest
      weight ~0.1 over 54 keys); x2 on both gives std ~3.8 (largest weight ~0.55): attention is sharp, so errors in
      the cached K change which past tokens it reads.
    * `attn1.to_out.0` x `self_attn_out`: what attention reads from the cache dominates the residual update.
    * `attn2.to_out.0` and `ffn.net.2` x `cross_attn_out` / `ffn_out`: the paths that never see the cache shrink.
    The VAE is left as it is: its decode already spreads pixels widely (frame std ~80 of 255), so latent changes
    reach the pixels."""
    g = {**KV_SENSITIVE_GAINS, **(gains or {})}
    if unknown := set(g) - set(KV_SENSITIVE_GAINS):
        raise ValueError(f"unknown gains {sorted(unknown)}; expected some of {sorted(KV_SENSITIVE_GAINS)}")
    for block in transformer.blocks:
        block.attn1.norm_q.weight.mul_(g["qk"])
        block.attn1.norm_k.weight.mul_(g["qk"])
        for linear, gain in ((block.attn1.to_out[0], g["self_attn_out"]),
                             (block.attn2.to_out[0], g["cross_attn_out"]), (block.ffn.net[2], g["ffn_out"])):
            linear.weight.mul_(gain)
            linear.bias.mul_(gain)
    return transformer


def tiny_transformer(seed: int = 0, config: dict[str, Any] | None = None, *, kv_sensitive: bool = False):
    """A diffusers WanTransformer3DModel of the tiny config with deterministic weights (fp32, CPU); with
    `kv_sensitive`, rescaled by `kv_sensitive_` so KV-cache compression shows in its rollouts."""
    from diffusers import WanTransformer3DModel

    transformer = reinit_(WanTransformer3DModel(**(config or TINY_DIT)), seed, "dit")
    if kv_sensitive:
        kv_sensitive_(transformer)
    return transformer.eval()


def tiny_dit(seed: int = 0, config: dict[str, Any] | None = None, *, kv_sensitive: bool = False):
    from mmkv.pipelines.wan.model import CausalWan

    return CausalWan(tiny_transformer(seed, config, kv_sensitive=kv_sensitive))


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The DiT weights under original Wan key names (the inverse of `mmkv.pipelines.wan.keymaps`' DiT table)."""
    return {dit_key_to_original(k): v.detach().clone() for k, v in transformer.state_dict().items()}


def write_causvid_checkpoint(transformer, path: str | Path, *, seed: int = 0) -> Path:
    """CausVid `model.pt`: {"generator": {"model." + key}, "critic": {...}} (CausVid `causvid/train_distillation.py`
    saves both). The critic is a small seeded stand-in (the loader ignores it), so the same model writes the same
    bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = original_state_dict(transformer)
    g = private_generator(seed, "tiny", "causvid-critic")
    critic = {"model." + k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in list(sd.items())[:3]}
    torch.save({"generator": {"model." + k: v for k, v in sd.items()}, "critic": critic}, path)
    return path


def write_causal_forcing_checkpoint(transformer, path: str | Path, *, ema: bool = True) -> Path:
    """Causal Forcing `.pt`: one entry, `generator_ema` with FSDP path segments, or `generator` (its
    trainer/distillation.py:188-210)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = original_state_dict(transformer)
    if ema:
        obj = {"generator_ema": {"model._fsdp_wrapped_module." + k: v for k, v in sd.items()}}
    else:
        obj = {"generator": {"model." + k: v for k, v in sd.items()}}
    torch.save(obj, path)
    return path


def write_self_forcing_checkpoint(transformer, path: str | Path, *, seed: int = 0) -> Path:
    """Self-Forcing `self_forcing_dmd.pt`: {"generator", "critic", "generator_ema"}, each `model.` + original key
    (FSDP full state dicts, so no wrapper segments; Self-Forcing `trainer/distillation.py` `save`). `transformer` goes
    to `generator_ema`, the entry inference runs; `generator` holds the same weights plus a small deterministic
    perturbation, as training weights differ from their EMA, so a test can tell which entry was loaded."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = original_state_dict(transformer)
    g = private_generator(seed, "tiny", "self-forcing-generator")
    train = {k: v + 1e-3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sd.items()}
    critic = {"model." + k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in list(sd.items())[:3]}
    torch.save({"generator": {"model." + k: v for k, v in train.items()}, "critic": critic,
                "generator_ema": {"model." + k: v for k, v in sd.items()}}, path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# VAE, text encoder, tokenizer


def tiny_vae(seed: int = 0):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**TINY_VAE)
    return reinit_(vae, seed, "vae").eval()


def tiny_text_encoder(seed: int = 0):
    from transformers import UMT5Config, UMT5EncoderModel

    enc = UMT5EncoderModel(UMT5Config(**TINY_T5))
    reinit_(enc, seed, "t5")
    enc.tie_weights()
    return enc.eval()


def tiny_tokenizer(text_len: int = TINY_TEXT_LEN):
    """A character-level fast tokenizer with the T5 call contract: pad 0, eos 1 appended, unk 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for c in sorted(set(string.printable) - set(string.whitespace)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=text_len)


def vae_diffusers_to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of diffusers' `convert_wan_vae_to_diffusers` for the 1.3B layout (tests round-trip it)."""
    import re

    fixed = {
        "encoder.conv_in.": "encoder.conv1.", "decoder.conv_in.": "decoder.conv1.",
        "encoder.norm_out.gamma": "encoder.head.0.gamma", "encoder.conv_out.": "encoder.head.2.",
        "decoder.norm_out.gamma": "decoder.head.0.gamma", "decoder.conv_out.": "decoder.head.2.",
        "quant_conv.": "conv1.", "post_quant_conv.": "conv2.",
    }
    res = {".norm1.gamma": ".residual.0.gamma", ".conv1.": ".residual.2.", ".norm2.gamma": ".residual.3.gamma",
           ".conv2.": ".residual.6.", ".conv_shortcut.": ".shortcut."}
    out = {}
    for key, value in sd.items():
        k = key
        for a, b in fixed.items():
            if k.startswith(a):
                k = b + k[len(a):]
                break
        if m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)", k):
            k = f"{m[1]}.middle.{2 * int(m[2])}.{m[3]}"
            for a, b in res.items():
                k = k.replace(a, b)
        elif m := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", k):
            k = f"{m[1]}.middle.1.{m[2]}"
        elif m := re.match(r"encoder\.down_blocks\.(\d+)\.(.+)", k):
            rest = m[2]
            for a, b in res.items():
                rest = rest.replace(a, b)
            k = f"encoder.downsamples.{m[1]}.{rest}"
        elif m := re.match(r"decoder\.up_blocks\.(\d)\.resnets\.(\d)\.(.+)", k):
            rest = "." + m[3]
            for a, b in res.items():
                rest = rest.replace(a, b)
            k = f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}{rest}"
        elif m := re.match(r"decoder\.up_blocks\.(\d)\.upsamplers\.0\.(.+)", k):
            k = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        out[k] = value
    return out


def t5_transformers_to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of the umT5 mapping (`mmkv.pipelines.wan.keymaps`); the tied `encoder.embed_tokens` copy is dropped."""
    out = {}
    for key, value in sd.items():
        if key == "encoder.embed_tokens.weight":
            continue
        name = t5_key_to_original(key)
        if name is None:
            raise KeyError(f"no original name for umT5 key {key!r}")
        out[name] = value.detach().clone()
    return out


def write_tiny_base(path: str | Path, layout: str = "diffusers", seed: int = 0) -> Path:
    """A base Wan directory with the tiny VAE, umT5 encoder, tokenizer and DiT config, in either layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vae, enc, tok = tiny_vae(seed), tiny_text_encoder(seed), tiny_tokenizer()
    if layout == "diffusers":
        save_pretrained(vae, path / "vae")
        save_pretrained(enc, path / "text_encoder")
        save_pretrained(tok, path / "tokenizer")
        (path / "transformer").mkdir(exist_ok=True)
        cfg = {"_class_name": "WanTransformer3DModel", **{k: list(v) if isinstance(v, tuple) else v
                                                          for k, v in TINY_DIT.items()}, "text_len": TINY_TEXT_LEN}
        (path / "transformer" / "config.json").write_text(json.dumps(cfg, indent=2))
        (path / "model_index.json").write_text(json.dumps({
            "_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"], "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        }, indent=2))
    elif layout == "original":
        torch.save(vae_diffusers_to_original(vae.state_dict()), path / "Wan2.1_VAE.pth")
        torch.save(t5_transformers_to_original(enc.state_dict()), path / "models_t5_umt5-xxl-enc-bf16.pth")
        save_pretrained(tok, path / "google" / "umt5-xxl")
        d = TINY_DIT
        cfg = {"_class_name": "WanModel", "dim": d["num_attention_heads"] * d["attention_head_dim"],
               "eps": d["eps"], "ffn_dim": d["ffn_dim"], "freq_dim": d["freq_dim"], "in_dim": d["in_channels"],
               "model_type": "t2v", "num_heads": d["num_attention_heads"], "num_layers": d["num_layers"],
               "out_dim": d["out_channels"], "text_len": TINY_TEXT_LEN,
               # absent from the real config.json (defaults 4096 / 1024); the tiny model needs them
               "text_dim": d["text_dim"], "rope_max_seq_len": d["rope_max_seq_len"]}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    else:
        raise ValueError(f"layout must be 'diffusers' or 'original', got {layout!r}")
    return path


def write_tiny_assets(root: str | Path, *, layout: str = "diffusers", seed: int = 0,
                      kv_sensitive: bool = False) -> dict[str, Path]:
    """Everything `mmkv generate video` needs, tiny: a base directory, a CausVid `model.pt` folder, a Causal Forcing
    `.pt` and a Self-Forcing `.pt` of the same DiT (`kv_sensitive`: see `kv_sensitive_`). Use with `--frames 33
    --height 32 --width 48` (frame-wise presets: 17 frames)."""
    root = Path(root)
    transformer = tiny_transformer(seed, kv_sensitive=kv_sensitive)
    return {
        "base": write_tiny_base(root / f"base_{layout}", layout, seed=seed),
        "causvid": write_causvid_checkpoint(transformer, root / "causvid" / "model.pt", seed=seed).parent,
        "causal_forcing": write_causal_forcing_checkpoint(transformer, root / "causal_forcing" / "framewise.pt"),
        "self_forcing": write_self_forcing_checkpoint(transformer, root / "self_forcing" / "self_forcing_dmd.pt",
                                                      seed=seed),
    }

"""Loaders for CausVid / Causal Forcing / Self-Forcing checkpoints and the base Wan2.1 directory. Local files only,
no downloads.

* Causal DiT: a `.pt` holding {"generator": sd} (CausVid `model.pt`, also carrying "critic"),
  {"generator_ema": sd} / {"generator": sd} (Causal Forcing), or all three of "generator", "critic" and
  "generator_ema" (Self-Forcing's `self_forcing_dmd.pt`, written by its `trainer/distillation.py`; its
  `inference.py --use_ema`, the command its README gives, loads "generator_ema"). Keys are `model.` + original Wan
  names, possibly with FSDP path segments; or a flat safetensors file. Keys are normalised, renamed to diffusers
  names (`dit_key_to_diffusers`) and loaded strictly: a wrong layout fails with the missing and unexpected keys listed,
  in original naming.
* Base directory, original layout: `config.json`, `Wan2.1_VAE.pth`, `models_t5_umt5-xxl-enc-bf16.pth`,
  `google/umt5-xxl/`; or diffusers layout: `transformer/config.json`, `vae/`, `text_encoder/`, `tokenizer/`.
  The base DiT weights are never needed: the causal checkpoint holds all of them.

Pickles are read with `torch.load(weights_only=True)`, which never runs code (`read_checkpoint_file`). Weights go to
bf16 on GPU, fp32 on CPU.
"""

from __future__ import annotations

import json
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmkv.pipelines.common import check_checkpoint_file, check_finite, read_checkpoint_file, sha256_file
from mmkv.pipelines.wan.keymaps import (  # noqa: F401  (re-exported)
    dit_key_to_diffusers, dit_key_to_original, expected_original_keys, t5_key_to_original, t5_key_to_transformers,
)


class LoadError(ValueError):
    """A checkpoint or base directory that cannot be used; the message names the file and the problem."""


# ----------------------------------------------------------------------------------------------------------------
# Reading state dicts


def read_state_file(path: str | Path) -> Any:
    """A safetensors file (flat dict) or a torch.save file read with weights_only=True (no code is executed)."""
    return read_checkpoint_file(path, error=LoadError)


_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def normalize_keys(sd: dict[str, Any]) -> dict[str, Any]:
    """Drop FSDP / activation-checkpoint / compile path segments and a leading `model.` or `model.diffusion_model.`
    (as Causal Forcing's inference.py:69-83 strips FSDP prefixes)."""
    out = {}
    for key, value in sd.items():
        k = key
        for seg in _WRAPPER_SEGMENTS:
            k = k.replace(seg, "")
        for prefix in ("model.diffusion_model.", "diffusion_model.", "model."):
            if k.startswith(prefix):
                k = k[len(prefix):]
                break
        if k in out:
            raise LoadError(f"two checkpoint keys normalise to the same name {k!r} (one is {key!r})")
        out[k] = value
    return out


def select_generator(obj: Any, path: Path, key: str | None = None) -> tuple[dict[str, torch.Tensor], str | None]:
    """(state dict, entry name) of the generator inside a training checkpoint: `key` if given, else `generator_ema`
    (the EMA weights Causal Forcing and Self-Forcing run inference with), else `generator`; a flat dict of tensors is
    taken as is (entry None). A `critic` entry (CausVid, Self-Forcing) is never loaded."""
    if not isinstance(obj, dict):
        raise LoadError(f"checkpoint file {path} holds a {type(obj).__name__}, expected a dict of tensors")
    if key is not None:
        if key not in obj:
            raise LoadError(f"checkpoint file {path} has no entry {key!r}; top-level keys: {_preview(obj)}")
    elif obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, None
    elif "generator_ema" in obj:
        key = "generator_ema"
    elif "generator" in obj:
        key = "generator"
    else:
        raise LoadError(
            f"checkpoint file {path} has neither 'generator_ema' nor 'generator' (CausVid / Causal Forcing / "
            f"Self-Forcing layouts) nor flat tensors; top-level keys: {_preview(obj)}"
        )
    sd = obj[key]
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise LoadError(f"checkpoint file {path}: entry {key!r} is not a non-empty dict of tensors")
    return sd, key


def _preview(names: Any, n: int = 8) -> str:
    names = sorted(map(str, names))
    more = f", ... ({len(names)} in all)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


# ----------------------------------------------------------------------------------------------------------------
# DiT config and construction

# The released Wan2.1-T2V-1.3B transformer in diffusers kwargs (diffusers scripts/convert_wan_to_diffusers.py:
# 328-346). Used by tests and as documentation; a run reads its config from the base directory.
WAN21_T2V_1_3B: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024, "text_len": 512,
}


def read_dit_config(base: Path, layout: str) -> dict[str, Any]:
    """diffusers `WanTransformer3DModel` kwargs (plus `text_len`) from the base directory's config."""
    if layout == "diffusers":
        path = base / "transformer" / "config.json"
        raw = _read_json(path)
        text_len = int(raw.get("text_len", 512))  # not a diffusers field; WanPipeline's max_sequence_length is 512
        allowed = {"patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                   "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps",
                   "image_dim", "added_kv_proj_dim", "rope_max_seq_len", "pos_embed_seq_len"}
        cfg = {k: v for k, v in raw.items() if k in allowed}
        need = ("num_attention_heads", "attention_head_dim", "num_layers", "ffn_dim")
    else:
        path = base / "config.json"
        raw = _read_json(path)
        need = ("dim", "num_heads", "num_layers", "ffn_dim")
        missing = [k for k in need if k not in raw]
        if missing:
            raise LoadError(f"{path}: missing {missing}; expected the original Wan config (dim, num_heads, ...)")
        if raw["dim"] % raw["num_heads"]:
            raise LoadError(f"{path}: dim {raw['dim']} is not divisible by num_heads {raw['num_heads']}")
        # Fields absent from the original config.json take the original code's defaults
        # (CausVid causal_model.py:286-288).
        cfg = {
            "patch_size": tuple(raw.get("patch_size", (1, 2, 2))),
            "num_attention_heads": raw["num_heads"],
            "attention_head_dim": raw["dim"] // raw["num_heads"],
            "in_channels": raw.get("in_dim", 16),
            "out_channels": raw.get("out_dim", 16),
            "text_dim": raw.get("text_dim", 4096),
            "freq_dim": raw.get("freq_dim", 256),
            "ffn_dim": raw["ffn_dim"],
            "num_layers": raw["num_layers"],
            "cross_attn_norm": raw.get("cross_attn_norm", True),
            "qk_norm": "rms_norm_across_heads",
            "eps": raw.get("eps", 1e-6),
            "rope_max_seq_len": raw.get("rope_max_seq_len", 1024),
        }
        text_len = int(raw.get("text_len", 512))
        need = ()
    missing = [k for k in need if k not in cfg]
    if missing:
        raise LoadError(f"{path}: missing {missing}")
    cfg["patch_size"] = tuple(cfg.get("patch_size", (1, 2, 2)))
    _check_head_dim(cfg, path, layout)
    return {**cfg, "text_len": text_len}


def _check_head_dim(cfg: dict[str, Any], path: Path, layout: str) -> None:
    """Wan's 3D RoPE splits a head into time / height / width parts, h = w = 2 * (d // 6) and t = d - h - w, each
    rotated in pairs (diffusers' `WanRotaryPosEmbed` asserts even parts): d must be even, and at least 6 so that the
    height and width parts are not empty. Checked here so a bad config is a one-line error, not an assertion."""
    d, heads = cfg["attention_head_dim"], cfg["num_attention_heads"]
    if isinstance(d, int) and d >= 6 and d % 2 == 0:
        return
    given = (f"dim {d * heads} / num_heads {heads}" if layout == "original" and isinstance(d, int)
             else f"attention_head_dim {d!r}")
    raise LoadError(
        f"{path}: head dimension {d} ({given}) cannot be rotated by Wan's 3D RoPE, which needs an even head "
        f"dimension of at least 6 (Wan2.1-T2V-1.3B: dim 1536 / 12 heads = 128); choose a config where "
        f"dim / num_heads is an even number >= 6"
    )


def build_dit(config: dict[str, Any], state_dict: dict[str, torch.Tensor] | None = None, *, source: str = "",
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """A `CausalWan` from diffusers kwargs; with `state_dict` (original or diffusers keys) loaded strictly."""
    from diffusers import WanTransformer3DModel

    from mmkv.pipelines.wan.model import CausalWan

    kwargs = {k: v for k, v in config.items() if k != "text_len"}
    if state_dict is None:
        return CausalWan(WanTransformer3DModel(**kwargs)).to(device=device, dtype=dtype)
    with torch.device("meta"):
        transformer = WanTransformer3DModel(**kwargs)
    sd = {dit_key_to_diffusers(k): v for k, v in state_dict.items()}
    expected = {k: tuple(v.shape) for k, v in transformer.state_dict().items()}
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise LoadError(
            f"{source}: the checkpoint does not match a Wan DiT with {config['num_layers']} layers "
            f"({expected_original_keys(config['num_layers'])} tensors expected, {len(state_dict)} found). "
            f"Missing keys ({len(missing)}): {_preview([dit_key_to_original(k) for k in missing])}. "
            f"Unexpected keys ({len(unexpected)}): {_preview([dit_key_to_original(k) for k in unexpected])}"
        )
    bad = [f"{dit_key_to_original(k)} {tuple(sd[k].shape)} (expected {expected[k]})"
           for k in expected if tuple(sd[k].shape) != expected[k]]
    if bad:
        raise LoadError(f"{source}: tensor shapes do not match the config: {_preview(bad, 6)}")
    transformer.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True, assign=True)
    return CausalWan(transformer).to(device=device, dtype=dtype)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint file: `path` itself, or the one `.pt`/`.pth`/`.safetensors` file in directory `path`
    (`model.pt` preferred, as CausVid names it). A file of no checkpoint format fails here, before a run starts."""
    path = Path(path)
    if path.is_file():
        check_checkpoint_file(path, error=LoadError)
        return path
    if not path.exists():
        raise LoadError(f"checkpoint path {path} does not exist")
    files = sorted(p for p in path.iterdir() if p.suffix in (".pt", ".pth", ".safetensors") and p.is_file())
    if (path / "model.pt").is_file():
        files = [path / "model.pt"]
    if len(files) == 1:
        check_checkpoint_file(files[0], error=LoadError)
        return files[0]
    if not files:
        raise LoadError(f"checkpoint directory {path} holds no .pt, .pth or .safetensors file")
    raise LoadError(
        f"checkpoint directory {path} holds several checkpoints ({', '.join(p.name for p in files)}); "
        "pass the file itself to --ckpt"
    )


def load_causal_dit(ckpt: str | Path, config: dict[str, Any], *, key: str | None = None,
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """(CausalWan, info) from a CausVid / Causal Forcing / Self-Forcing checkpoint file or directory."""
    path = find_checkpoint(ckpt)
    obj = read_state_file(path)
    raw, picked = select_generator(obj, path, key)
    sd = normalize_keys(raw)
    check_finite(sd, f"checkpoint file {path}")
    dit = build_dit(config, sd, source=str(path), device=device, dtype=dtype)
    info = {"path": str(path.resolve()), "sha256": sha256_file(path), "entry": picked, "num_tensors": len(sd)}
    return dit, info


# ----------------------------------------------------------------------------------------------------------------
# Base directory: layout, VAE, text encoder


def detect_layout(base: str | Path) -> str:
    base = Path(base)
    if not base.is_dir():
        raise LoadError(f"base model directory {base} does not exist or is not a directory")
    if (base / "model_index.json").is_file() or (base / "vae").is_dir():
        return "diffusers"
    if (base / "Wan2.1_VAE.pth").is_file() or (base / "config.json").is_file():
        return "original"
    raise LoadError(
        f"base model directory {base} is neither the original Wan2.1 layout (config.json, Wan2.1_VAE.pth, "
        "models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/) nor the diffusers layout (model_index.json, vae/, "
        "text_encoder/, tokenizer/)"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LoadError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoadError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path} does not hold a JSON object")
    return data


# -- VAE --

def vae_original_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    return convert_wan_vae_to_diffusers(dict(sd))


def load_vae(base: Path, layout: str, *, device, dtype):
    """(AutoencoderKLWan, info). Original `Wan2.1_VAE.pth` is converted (dim_mult [1,2,4,4], 2 res blocks; the base
    width is read from the file)."""
    from diffusers import AutoencoderKLWan

    if layout == "diffusers":
        folder = base / "vae"
        if not (folder / "config.json").is_file():
            raise LoadError(f"VAE folder {folder} has no config.json")
        try:
            vae = AutoencoderKLWan.from_pretrained(folder, torch_dtype=dtype, local_files_only=True,
                                                   low_cpu_mem_usage=False)
        except (OSError, ValueError, RuntimeError) as err:
            raise LoadError(f"VAE folder {folder} could not be loaded: {err}") from None
        files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    else:
        path = base / "Wan2.1_VAE.pth"
        sd = read_state_file(path)
        if not isinstance(sd, dict) or "encoder.conv1.weight" not in sd or "conv2.weight" not in sd:
            raise LoadError(f"{path} is not a Wan2.1 VAE state dict (no encoder.conv1.weight / conv2.weight)")
        base_dim, z_dim = sd["encoder.conv1.weight"].shape[0], sd["conv2.weight"].shape[0]
        # The original builder hard-codes these (Causal Forcing wan/modules/vae.py:612-636).
        with torch.device("meta"):
            vae = AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                   attn_scales=[], temperal_downsample=[False, True, True])
        conv = {k: v.to(dtype) for k, v in vae_original_to_diffusers(sd).items()}
        _strict_load(vae, conv, path)  # assign=True: the tensors (already in `dtype`) become the parameters
        files = [path]
    vae = cpu_vae_paths_(vae.to(device=device).eval().requires_grad_(False))
    return vae, {"files": [_file_info(p) for p in files]}


def _onednn_conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if (input.device.type == "cpu" and input.dtype == torch.float32 and weight.dtype == torch.float32
            and self.padding_mode == "zeros" and not torch.is_grad_enabled() and torch.backends.mkldnn.enabled):
        return torch.ops.aten.mkldnn_convolution(input, weight, bias, self.padding, self.stride, self.dilation,
                                                 self.groups)
    return torch.nn.Conv3d._conv_forward(self, input, weight, bias)


def onednn_conv3d_(module: torch.nn.Module) -> torch.nn.Module:
    """Route `module`'s 3-D convolutions through oneDNN on the CPU (float32, no autograd), in place; returns it.

    For a 5-D input of batch 1 torch's CPU convolution takes its oneDNN kernel only when N x C x T x H > 20480
    (`ConvParams::use_mkldnn`, aten/src/ATen/native/Convolution.cpp), a threshold written for 4-D inputs: the Wan
    VAE's causal convolutions see 2-6 frames at a time, so they fall to `slow_conv3d` (im2col, one thread). The tiny
    VAE then decodes 81 frames at 64 x 96 in 10.4 s on one thread, against 3.3 s through oneDNN (two threads: 8.1
    against 2.6 s; encode 4.7 against 1.6 s). The two paths agree to float32 rounding (max |delta| 3e-6 on the
    decoded frames), not bit for bit; every rollout of a run decodes through the same path. Elsewhere (CUDA, bf16,
    autograd, `torch.backends.mkldnn.flags(enabled=False)`) the module runs torch's own choice."""
    import types

    if not torch.backends.mkldnn.is_available():
        return module
    for m in module.modules():
        if isinstance(m, torch.nn.Conv3d):
            m._conv_forward = types.MethodType(_onednn_conv_forward, m)
    return module


def _sum_of_squares_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled():
        # F.normalize's x / max(||x||_2, eps), the norm as the square root of a sum of squares
        norm = (x * x).sum(dim=1 if self.channel_first else -1, keepdim=True).sqrt().clamp_min(1e-12)
        return x / norm * self.scale * self.gamma + self.bias
    return type(self).forward(self, x)


def cpu_vae_paths_(vae: torch.nn.Module) -> torch.nn.Module:
    """The Wan VAE's faster CPU paths (float32, no autograd), in place; returns it. Its 3-D convolutions go through
    oneDNN (`onednn_conv3d_`), and its RMS norms (diffusers `WanRMS_norm`: `F.normalize` over the channels) take the
    channel norm as the square root of a sum of squares: torch's `linalg_vector_norm` over the channel axis of an
    [N, C, T, H, W] tensor is a strided reduction that took 27% of the tiny VAE's decode on one thread (0.69 of
    2.55 s for 81 frames at 64 x 96, 504 calls), the sum of squares 10-20x less a call. The two agree to float32
    rounding (one ulp of the normalised values), not bit for bit; every rollout of a run decodes through the same
    path. Elsewhere (CUDA, bf16, autograd) the modules run diffusers' own code."""
    onednn_conv3d_(vae)
    for m in vae.modules():
        if type(m).__name__ == "WanRMS_norm":
            m.forward = types.MethodType(_sum_of_squares_rms_norm_forward, m)
    return vae


def _strict_load(module: torch.nn.Module, sd: dict[str, torch.Tensor], path: Path):
    expected = module.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise LoadError(
            f"{path}: keys do not match. Missing ({len(missing)}): {_preview(missing)}. "
            f"Unexpected ({len(unexpected)}): {_preview(unexpected)}"
        )
    bad = [f"{k} {tuple(sd[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
           if tuple(sd[k].shape) != tuple(v.shape)]
    if bad:
        raise LoadError(f"{path}: tensor shapes do not match: {_preview(bad, 6)}")
    return module.load_state_dict(sd, strict=True, assign=True)


# -- umT5 text encoder (CausVid wan_base/modules/t5.py -> transformers UMT5EncoderModel) --

def t5_original_config(sd: dict[str, torch.Tensor], path: Path):
    """UMT5Config from the shapes of an original Wan umT5 encoder state dict (CausVid t5.py `umt5_xxl`)."""
    from transformers import UMT5Config

    try:
        vocab, d_model = sd["token_embedding.weight"].shape
        num_layers = len({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
        buckets, heads = sd["blocks.0.pos_embedding.embedding.weight"].shape
        d_ff = sd["blocks.0.ffn.fc1.weight"].shape[0]
        inner = sd["blocks.0.attn.q.weight"].shape[0]
    except KeyError as err:
        raise LoadError(f"{path} is not an original umT5 encoder state dict (no {err.args[0]})") from None
    return UMT5Config(
        vocab_size=vocab, d_model=d_model, d_kv=inner // heads, d_ff=d_ff, num_layers=num_layers, num_heads=heads,
        relative_attention_num_buckets=buckets, relative_attention_max_distance=128,  # hard-coded in Wan's t5.py
        feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0, is_encoder_decoder=False,
        tie_word_embeddings=True,
    )


def load_text_encoder(base: Path, layout: str, *, device, dtype):
    """(tokenizer, UMT5EncoderModel, info)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    if layout == "diffusers":
        folder, tok_folder = base / "text_encoder", base / "tokenizer"
        if not (folder / "config.json").is_file():
            raise LoadError(f"text encoder folder {folder} has no config.json")
        try:
            encoder = UMT5EncoderModel.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as err:
            raise LoadError(f"text encoder folder {folder} could not be loaded: {err}") from None
        files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    else:
        path = base / "models_t5_umt5-xxl-enc-bf16.pth"
        tok_folder = base / "google" / "umt5-xxl"
        sd = read_state_file(path)
        if not isinstance(sd, dict):
            raise LoadError(f"{path} does not hold a state dict")
        config = t5_original_config(sd, path)
        with torch.device("meta"):
            encoder = UMT5EncoderModel(config)
        conv = {t5_key_to_transformers(k): v.to(dtype) for k, v in sd.items()}
        if "shared.weight" in conv:
            conv["encoder.embed_tokens.weight"] = conv["shared.weight"]  # tied
        _strict_load(encoder, conv, path)
        files = [path]
    if not tok_folder.is_dir():
        raise LoadError(f"tokenizer folder {tok_folder} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise LoadError(f"tokenizer folder {tok_folder} could not be loaded: {err}") from None
    encoder = encoder.to(device=device).eval().requires_grad_(False)
    return tokenizer, encoder, {"files": [_file_info(p) for p in files], "tokenizer": str(tok_folder.resolve())}


def base_files(base: str | Path) -> list[Path]:
    """The files of a base directory that a run reads (DiT config, VAE, umT5, tokenizer; not the base DiT weights,
    which the causal checkpoint replaces): what its SHA-256 covers."""
    base = Path(base)
    if detect_layout(base) == "diffusers":
        folders = [base / "vae", base / "text_encoder", base / "tokenizer"]
        singles = [base / "transformer" / "config.json"]
    else:
        folders = [base / "google" / "umt5-xxl"]
        singles = [base / "config.json", base / "Wan2.1_VAE.pth", base / "models_t5_umt5-xxl-enc-bf16.pth"]
    files = [p for p in singles if p.is_file()]
    files += [p for d in folders if d.is_dir() for p in sorted(d.rglob("*")) if p.is_file()]
    return files


def _file_info(path: Path) -> dict[str, Any]:
    return {"path": str(Path(path).resolve()), "sha256": sha256_file(path), "bytes": Path(path).stat().st_size}


# ----------------------------------------------------------------------------------------------------------------
# Everything together


@dataclass
class WanComponents:
    dit: Any  # CausalWan
    vae: Any  # AutoencoderKLWan
    tokenizer: Any
    text_encoder: Any
    text_len: int
    layout: str
    device: torch.device
    dtype: torch.dtype
    files: dict[str, Any] = field(default_factory=dict)  # what was loaded, with SHA-256


def default_device_dtype(device: str | torch.device | None = None) -> tuple[torch.device, torch.dtype]:
    """bf16 on GPU (what the repos run: CausVid wan_wrapper.py, Causal Forcing inference.py:60-91), fp32 on CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)


def load_wan(ckpt: str | Path, base: str | Path, *, device: str | torch.device | None = None,
             dtype: torch.dtype | None = None, ckpt_key: str | None = None) -> WanComponents:
    """Causal DiT from `ckpt`, VAE + umT5 + tokenizer (+ DiT config) from `base`."""
    base = Path(base)
    layout = detect_layout(base)
    dev, default_dtype = default_device_dtype(device)
    dtype = dtype or default_dtype
    config = read_dit_config(base, layout)
    dit, dit_info = load_causal_dit(ckpt, config, key=ckpt_key, device=dev, dtype=dtype)
    vae, vae_info = load_vae(base, layout, device=dev, dtype=dtype)
    tokenizer, encoder, t5_info = load_text_encoder(base, layout, device=dev, dtype=dtype)
    if encoder.config.d_model != config["text_dim"]:
        raise LoadError(
            f"{base}: the text encoder's width {encoder.config.d_model} differs from the DiT's text_dim "
            f"{config['text_dim']}"
        )
    if vae.config.z_dim != config["in_channels"]:
        raise LoadError(f"{base}: VAE z_dim {vae.config.z_dim} differs from the DiT's in_channels "
                        f"{config['in_channels']}")
    files = {"dit": dit_info, "vae": vae_info, "text_encoder": t5_info, "base": str(base.resolve()),
             "layout": layout, "dit_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()}}
    return WanComponents(dit, vae, tokenizer, encoder, config["text_len"], layout, dev, dtype, files)


def vae_factors(vae) -> tuple[int, int]:
    """(temporal, spatial) compression of a Wan VAE, from its config."""
    cfg = vae.config
    t = getattr(cfg, "scale_factor_temporal", None) or 2 ** sum(bool(x) for x in cfg.temperal_downsample)
    s = getattr(cfg, "scale_factor_spatial", None) or 2 ** (len(cfg.dim_mult) - 1)
    return int(t), int(s)


def base_vae_factors(base: str | Path) -> tuple[int, int]:
    """(temporal, spatial) VAE compression read from the base directory's config, without loading weights (the
    original Wan2.1 VAE is 4x / 8x, hard-coded in its builder)."""
    base = Path(base)
    if detect_layout(base) == "original":
        return 4, 8
    cfg = _read_json(base / "vae" / "config.json")
    t = cfg.get("scale_factor_temporal") or 2 ** sum(bool(x) for x in cfg.get("temperal_downsample", [0, 1, 1]))
    s = cfg.get("scale_factor_spatial") or 2 ** (len(cfg.get("dim_mult", [1, 2, 4, 4])) - 1)
    return int(t), int(s)


def latent_latents_stats(vae, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(vae.config.latents_mean, device=device, dtype=dtype)
    std = torch.tensor(vae.config.latents_std, device=device, dtype=dtype)
    if mean.numel() != vae.config.z_dim or std.numel() != vae.config.z_dim:
        raise LoadError(f"VAE config latents_mean/std have {mean.numel()}/{std.numel()} entries, z_dim is "
                        f"{vae.config.z_dim}")
    return mean, std


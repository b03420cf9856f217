"""Load the released AAR / SAT checkpoints (or tiny ones in the same format) from a local directory, strictly.

Container format (AAR inference_AAR.py, train_AAR_mpi.py `save_checkpoint`): `torch.load(path)['model_state_dict']` for
AAR and `['generator_state_dict']` for SAT, keys possibly prefixed `module.` (saved from DDP); a bare state dict and
`.safetensors` files are accepted too. Pickles are read with `weights_only=True` and never fully unpickled
(`read_checkpoint_file`): numpy scalars and an `argparse.Namespace` beside the weights are read as data; any other
pickled object is refused, naming it.

Releases (`mmkv ship audio`, `mmkv.pipelines.aar.release`) leave out state that inference never reads
(`release_drops`): AAR's block-causal training mask `attn_bias_for_masking` (a function of `lvl_1L`; the cached
rollout passes no mask), the SAT codebooks' EMA k-means state `cluster_size` / `embed_avg` (only training updates
them; lookup reads `embed`) and the SAT's SEANet encoder (a rollout decodes tokens; only training encodes clips).
When such state is absent, `fill_dropped` rebuilds the buffers before the strict load (the mask exactly, the EMA
state as `SAT.init_weights` starts it: `embed_avg = embed`, counts 1), the SAT's architecture is read off its decoder,
and its encoder is `EncoderLeftOut`, which raises if called. A full checkpoint loads as before; any other missing key
is still an error.

Weight norm: the model keeps the legacy `weight_g` / `weight_v` names; files written with the modern
parametrization (`parametrizations.weight.original0/1`) or with folded `weight`s are mapped onto them.

The architecture is read off the state dict (depth from the block count, the scale schedule from `lvl_1L`, widths
from shapes), so one loader serves the released models and the tiny test models; the strict load then checks every
key and shape, and a mismatch raises an error that lists the missing, unexpected and mis-shaped keys.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from mmkv.assets import TRAINING_PREFIX
from mmkv.pipelines.aar.model import AAR, AARConfig, build_aar
from mmkv.pipelines.aar.sat import SAT, SATConfig, build_sat
from mmkv.pipelines.common import check_finite, read_checkpoint_file

AAR_CONTAINER_KEY = "model_state_dict"
SAT_CONTAINER_KEY = "generator_state_dict"
AAR_RELEASED_NAME = "AAR_d16_bs2048.pth"
SAT_RELEASED_NAME = "SAT_d128_lat128.pth"
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")
_PREFIXES = ("module.", "_orig_mod.")
# What a release may leave out, per model (see the module docstring): key suffixes, and the SAT encoder's prefix.
DROPPED_SUFFIXES = {"AAR": ("attn_bias_for_masking",), "SAT": ("._codebook.cluster_size", "._codebook.embed_avg")}
SAT_ENCODER = "encoder."
# A release with its training state keeps what only training reads in `training/<checkpoint name>` beside the
# checkpoint (`mmkv ship audio --training-state`): the installed package leaves that folder out (pyproject.toml),
# a checkout keeps it for `--init`. The loaders read it back when it is there.
TRAINING_DIR = TRAINING_PREFIX.rstrip("/")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the model; the message names the file and the keys."""


# ----------------------------------------------------------------------------------------------------------------
# Reading


def read_state_dict(path: str | os.PathLike, container_key: str) -> dict[str, torch.Tensor]:
    """The state dict inside a checkpoint file: `obj[container_key]` or a bare state dict, `module.` stripped."""
    path = Path(path)
    obj: Any = read_checkpoint_file(path, error=CheckpointError)
    if isinstance(obj, dict) and container_key in obj:
        obj = obj[container_key]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        top = sorted(obj)[:12] if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(
            f"checkpoint {path}: expected a dict with {container_key!r} or a bare state dict of tensors; found {top}"
        )
    return strip_prefixes(obj)


def training_state_file(path: str | os.PathLike) -> Path:
    """Where a release keeps the training state of its checkpoint `path` (`TRAINING_DIR`)."""
    path = Path(path)
    return path.parent / TRAINING_DIR / path.name


def read_with_training_state(path: str | os.PathLike, container_key: str) -> dict[str, torch.Tensor]:
    """The state dict of `path` with the entries of its training-state file added when there is one. The two hold
    disjoint entries; a key in both is an error (the files would not belong together)."""
    sd = read_state_dict(path, container_key)
    extra_path = training_state_file(path)
    if not extra_path.is_file():
        return sd
    extra = read_state_dict(extra_path, container_key)
    both = sorted(set(sd) & set(extra))
    if both:
        raise CheckpointError(f"{extra_path} repeats entries of {path} ({_fmt_keys(both)}): a training-state file "
                              "holds only what the release leaves out")
    return {**sd, **extra}


def strip_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        for p in _PREFIXES:
            if k.startswith(p):
                k = k[len(p):]
        out[k] = v
    return out


def map_weight_norm_keys(sd: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Map modern-parametrization and folded weight-norm keys onto the legacy `weight_g` / `weight_v` names."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith(".parametrizations.weight.original0"):
            out[k[: -len("parametrizations.weight.original0")] + "weight_g"] = v
        elif k.endswith(".parametrizations.weight.original1"):
            out[k[: -len("parametrizations.weight.original1")] + "weight_v"] = v
        elif k.endswith(".weight") and k not in expected and (k[:-6] + "weight_g") in expected:
            # A folded weight w: g = ||w|| over every dim but 0, v = w reproduces it exactly.
            out[k[:-6] + "weight_g"] = v.norm(dim=tuple(range(1, v.dim())), keepdim=True)
            out[k[:-6] + "weight_v"] = v
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------------------------------
# Architecture from the state dict


def _need(sd: dict[str, torch.Tensor], key: str, what: str, path: Any) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"{what} checkpoint {path}: key {key!r} is missing, cannot read the architecture")
    return sd[key]


def infer_aar_config(sd: dict[str, torch.Tensor], path: Any = "<state dict>") -> AARConfig:
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not blocks:
        raise CheckpointError(f"AAR checkpoint {path}: no 'blocks.N.' keys; is this an AAR model_state_dict?")
    depth = max(blocks) + 1
    word = _need(sd, "word_embed.weight", "AAR", path)
    lvl = _need(sd, "lvl_1L", "AAR", path).reshape(-1).tolist()
    patch_nums = tuple(lvl.count(i) for i in range(int(max(lvl)) + 1))
    if not patch_nums or 0 in patch_nums or lvl != sorted(lvl):
        raise CheckpointError(f"AAR checkpoint {path}: buffer lvl_1L is not a valid level schedule")
    fc1 = _need(sd, "blocks.0.ffn.fc1.weight", "AAR", path)
    cfg = AARConfig(
        depth=depth,
        patch_nums=patch_nums,
        cvae=int(word.shape[1]),
        vocab_size=int(_need(sd, "head.weight", "AAR", path).shape[0]),
        input_dim=int(_need(sd, "class_emb.fc1.weight", "AAR", path).shape[1]),
        mlp_ratio=fc1.shape[0] / fc1.shape[1],
        cos_attn="blocks.0.attn.scale_mul_1H11" in sd,
    )
    if word.shape[0] != cfg.embed_dim:
        raise CheckpointError(
            f"AAR checkpoint {path}: width {word.shape[0]} is not 64 x depth ({depth} blocks); "
            f"the AAR builder ties embed_dim = 64 * depth"
        )
    return cfg


def infer_sat_config(sd: dict[str, torch.Tensor], multi_scale: tuple[int, ...], path: Any = "<state dict>") -> SATConfig:
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"quantizer\.vq\.layers\.(\d+)\._codebook\.", k))}
    if not layers:
        raise CheckpointError(f"SAT checkpoint {path}: no quantizer codebooks; is this a SAT generator_state_dict?")
    if len(layers) != len(multi_scale):
        raise CheckpointError(
            f"SAT checkpoint {path} has {len(layers)} codebooks (scales) but the AAR schedule has {len(multi_scale)} "
            f"scales {list(multi_scale)}; the tokenizer and the transformer do not belong together"
        )
    embed = _need(sd, "quantizer.vq.layers.0._codebook.embed", "SAT", path)
    phis = sorted({int(m.group(1)) for k in sd if (m := re.match(r"quantizer\.vq\.quant_resi\.qresi_ls\.(\d+)\.", k))})
    phi_kernel = tuple(int(sd[f"quantizer.vq.quant_resi.qresi_ls.{i}.weight"].shape[-1]) for i in phis)
    part = "encoder" if any(k.startswith(SAT_ENCODER) for k in sd) else "decoder"  # a release ships no encoder
    first = _need(sd, f"{part}.model.0.conv.conv.weight_v", "SAT", path)
    convtr = sorted(
        {int(m.group(1)) for k in sd if (m := re.match(r"decoder\.model\.(\d+)\.convtr\.convtr\.weight_v$", k))}
    )
    ratios = tuple(int(sd[f"decoder.model.{i}.convtr.convtr.weight_v"].shape[-1]) // 2 for i in convtr)
    n_res = sum(1 for k in sd if re.match(rf"{part}\.model\.\d+\.shortcut\.conv\.conv\.weight_v$", k))
    lstm = sum(1 for k in sd if re.match(rf"{part}\.model\.\d+\.lstm\.weight_ih_l\d+$", k))
    convs = sorted((k for k in sd if re.match(rf"{part}\.model\.\d+\.conv\.conv\.weight_v$", k)),
                   key=lambda k: int(k.split(".")[2]))
    last = sd[convs[-1]]
    if part == "encoder":  # first conv [n_filters, channels, 7], last [dimension, ...]
        n_filters, channels, dimension = int(first.shape[0]), int(first.shape[1]), int(last.shape[0])
    else:  # the decoder's first conv [..., dimension, 7], last [channels, n_filters, 7]
        n_filters, channels, dimension = int(last.shape[1]), int(last.shape[0]), int(first.shape[1])
    if not ratios or n_res % len(ratios):
        raise CheckpointError(f"SAT checkpoint {path}: cannot read the SEANet layout (ratios {ratios}, {n_res} res blocks)")
    return SATConfig(
        multi_scale=tuple(multi_scale),
        phi_kernel=phi_kernel,
        dimension=dimension,
        latent_dim=int(embed.shape[1]),
        ratios=ratios,
        n_residual_layers=n_res // len(ratios),
        lstm=lstm,
        n_filters=n_filters,
        channels=channels,
        bins=int(embed.shape[0]),
    )


# ----------------------------------------------------------------------------------------------------------------
# State a release drops


def release_drops(key: str, what: str) -> bool:
    """Whether a release of the `what` ("AAR" or "SAT") model leaves out the state dict entry `key`."""
    return key.endswith(DROPPED_SUFFIXES[what]) or (what == "SAT" and key.startswith(SAT_ENCODER))


class EncoderLeftOut(torch.nn.Module):
    """The SEANet encoder of a SAT release that ships without it: inference only decodes, so calling it is an error."""

    def __init__(self, path: Any):
        super().__init__()
        self.path = str(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise CheckpointError(f"SAT checkpoint {self.path} is a release without its encoder (rollouts only decode); "
                              "encoding clips (training, --init) needs the full SAT checkpoint")


def fill_dropped(sd: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """`sd` with the state a release leaves out (`release_drops`) rebuilt where it is missing (a full checkpoint comes
    back unchanged; the SAT encoder is not rebuilt: `load_sat` stubs it)."""
    out = dict(sd)
    if what == "AAR" and "attn_bias_for_masking" not in out and "lvl_1L" in out:
        d = out["lvl_1L"].reshape(1, -1, 1)  # the mask of AAR.__init__, from the level of every token
        out["attn_bias_for_masking"] = torch.where(d >= d.transpose(1, 2), 0.0, -torch.inf).unsqueeze(1)
    if what == "SAT":
        for key in [k for k in out if k.endswith("._codebook.embed")]:
            stem = key[: -len("embed")]
            out.setdefault(stem + "embed_avg", out[key].clone())
            out.setdefault(stem + "cluster_size", torch.ones(out[key].shape[0], dtype=out[key].dtype))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Strict loading


def _fmt_keys(keys: list[str], limit: int = 25) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_strict(model: torch.nn.Module, sd: dict[str, torch.Tensor], what: str, path: Any) -> None:
    """`load_state_dict(strict=True, assign=True)` after checking keys and shapes ourselves for a readable error."""
    expected = model.state_dict()
    sd = map_weight_norm_keys(sd, set(expected))
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes = sorted(
        f"{k} (file {tuple(sd[k].shape)}, model {tuple(expected[k].shape)})"
        for k in set(sd) & set(expected) if tuple(sd[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or shapes:
        parts = [f"{what} checkpoint {path} does not match the model"]
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_fmt_keys(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_fmt_keys(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches ({len(shapes)}): {_fmt_keys(shapes)}")
        raise CheckpointError("; ".join(parts))
    # Keep the stored dtypes of integer buffers (lvl_1L) but make float tensors fp32: the reference is fp32.
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    check_finite(sd, f"{what} checkpoint {path}", allow_inf=(name for name, _ in model.named_buffers()))
    model.load_state_dict(sd, strict=True, assign=True)


def load_aar(path: str | os.PathLike, config: AARConfig | None = None, *,
             device: torch.device | str = "cpu") -> AAR:
    sd = fill_dropped(read_with_training_state(path, AAR_CONTAINER_KEY), "AAR")
    cfg = config or infer_aar_config(sd, path)
    model = build_aar(cfg, "meta")
    load_strict(model, sd, "AAR", path)
    return model.to(device).eval().requires_grad_(False)


def load_sat(path: str | os.PathLike, config: SATConfig | None = None, *, multi_scale: tuple[int, ...] | None = None,
             device: torch.device | str = "cpu") -> SAT:
    sd = fill_dropped(read_with_training_state(path, SAT_CONTAINER_KEY), "SAT")
    if config is None:
        if multi_scale is None:
            raise CheckpointError(f"SAT checkpoint {path}: the scale schedule is not stored in the SAT; pass the AAR's")
        config = infer_sat_config(map_weight_norm_keys(sd, _sat_keys_hint(sd)), multi_scale, path)
    model = build_sat(config, "meta")
    if not any(k.startswith(SAT_ENCODER) for k in sd):
        model.encoder = EncoderLeftOut(path)
    load_strict(model, sd, "SAT", path)
    return model.to(device).eval().requires_grad_(False)


def _sat_keys_hint(sd: dict[str, torch.Tensor]) -> set[str]:
    # Folded `….conv.weight` keys of a SAT are weight-normed convs: name their legacy keys so they get mapped.
    return {k[:-6] + "weight_g" for k in sd if re.search(r"\.(conv|convtr)\.(conv|convtr)\.weight$", k)}


def save_released_format(model: AAR | SAT, path: str | os.PathLike, *, prefix: str = "", bare: bool = False) -> Path:
    """Write a checkpoint the way the official training scripts do (tests and tiny models)."""
    key = AAR_CONTAINER_KEY if isinstance(model, AAR) else SAT_CONTAINER_KEY
    sd = {prefix + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd if bare else {key: sd}, path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# A model directory


def find_checkpoints(directory: str | os.PathLike, sat: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(AAR file, SAT file) in `directory`: the released names if present, else the one `AAR*` / `SAT*` file."""
    d = Path(directory)
    if d.is_file():
        raise CheckpointError(f"--aar expects a directory holding {AAR_RELEASED_NAME} and {SAT_RELEASED_NAME}; got file {d}")
    if not d.is_dir():
        raise CheckpointError(f"AAR model directory {d} does not exist")

    def pick(released: str, stem: str) -> Path:
        if (d / released).is_file():
            return d / released
        found = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES
                       and p.name.upper().startswith(stem))
        if len(found) == 1:
            return found[0]
        if not found:
            raise CheckpointError(f"no {stem} checkpoint in {d} (expected {released} or one {stem}*.pth/.safetensors)")
        raise CheckpointError(f"several {stem} checkpoints in {d}: {[p.name for p in found]}; keep one or rename")

    return pick(AAR_RELEASED_NAME, "AAR"), (Path(sat) if sat else pick(SAT_RELEASED_NAME, "SAT"))


def load_models(directory: str | os.PathLike, *, sat: str | os.PathLike | None = None,
                device: torch.device | str = "cpu") -> tuple[AAR, SAT, dict[str, Any]]:
    """Load the AAR and its SAT from a directory and check that they belong together."""
    aar_path, sat_path = find_checkpoints(directory, sat)
    aar = load_aar(aar_path, device=device)
    sat_model = load_sat(sat_path, multi_scale=aar.patch_nums, device=device)
    check_pair(aar, sat_model, aar_path, sat_path)
    info = {"aar_path": str(aar_path), "sat_path": str(sat_path),
            "aar_config": aar.config.to_dict(), "sat_config": sat_model.config.to_dict()}
    return aar, sat_model, info


def check_pair(aar: AAR, sat: SAT, aar_path: Any = "AAR", sat_path: Any = "SAT") -> None:
    problems = []
    if aar.Cvae != sat.latent_dim:
        problems.append(f"AAR input width {aar.Cvae} != SAT latent_dim {sat.latent_dim}")
    if aar.V != sat.codebook_size:
        problems.append(f"AAR vocabulary {aar.V} != SAT codebook size {sat.codebook_size}")
    if tuple(aar.patch_nums) != tuple(sat.config.multi_scale):
        problems.append(f"AAR scales {list(aar.patch_nums)} != SAT scales {list(sat.config.multi_scale)}")
    if problems:
        raise CheckpointError(f"{aar_path} and {sat_path} do not belong together: " + "; ".join(problems))

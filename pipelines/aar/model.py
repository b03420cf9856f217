"""The AAR transformer (next-scale audio autoregression), written for mmkv.

Architecture of the official code (`qiuk2/AAR` at eaaf1bc: model/__init__.py `build_aar`, model/aar.py,
modules/basic_var.py, itself VAR's blocks). Attribute paths equal the official ones so `AAR_d16_bs2048.pth` loads
strictly, including the persistent buffers `uncond_embedding`, `zero_k_bias`, `lvl_1L` and `attn_bias_for_masking`.
Only the fp32 plain PyTorch attention path is kept (no flash-attn / xformers / fused MLP), so the cache layout is
always BHLc.

Self-attention reads and writes its KV cache through an `mmkv.cache.KVStore` when one is attached
(`with store.attach(aar): ...` sets `mmkv_store` on every module with an int `mmkv_layer`); one AR step (one scale)
appends one unit per layer. Without a store it keeps the official concatenating cache (`kv_caching`), which is the
numerical reference the store is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmkv.pipelines.aar.sat import AAR_PATCH_NUMS


@dataclass(frozen=True)
class AARConfig:
    """`build_aar` arguments (AAR model/__init__.py). Defaults are the released `AAR_d16_bs2048.pth`.

    The builder ties width and heads to depth: embed_dim = 64 * depth, num_heads = depth, so head_dim is always 64.
    """

    depth: int = 16
    patch_nums: tuple[int, ...] = AAR_PATCH_NUMS
    cvae: int = 128  # SAT latent_dim
    vocab_size: int = 1024  # SAT codebook size (bins)
    input_dim: int = 512  # CLAP embedding width; `uncond_embedding` is hard-coded (1, 512)
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-6
    cos_attn: bool = True  # config/inference/AAR.yaml
    tau: float = 4.0  # unused when cos_attn

    @property
    def embed_dim(self) -> int:
        return 64 * self.depth

    @property
    def num_heads(self) -> int:
        return self.depth

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def L(self) -> int:
        return sum(self.patch_nums)

    def to_dict(self) -> dict:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}
        d.update(embed_dim=self.embed_dim, num_heads=self.num_heads, head_dim=self.head_dim, L=self.L)
        return d


class MLP(nn.Module):
    """`class_emb`: Linear(512 -> C, no bias) -> GELU(tanh) -> Linear(C -> C, no bias)."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FFN(nn.Module):
    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SelfAttention(nn.Module):
    """Cosine self-attention with a KV cache (modules/basic_var.py `SelfAttention`, SDPA path only).

    Cached K are the post-normalisation unit keys, V the raw values plus `v_bias` (AAR modules/basic_var.py
    `SelfAttention`).
    """

    def __init__(self, block_idx: int, embed_dim: int, num_heads: int, tau: float = 4.0, cos_attn: bool = True):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.block_idx, self.num_heads, self.head_dim = block_idx, num_heads, embed_dim // num_heads
        self.mmkv_layer = block_idx  # the KVStore's layer index (store.attach looks for this attribute)
        self.cos_attn = cos_attn
        if cos_attn:
            self.scale = 1.0
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), 4.0).log())
            # float32 log(100), as upstream computes it (explicit CPU so a meta-device build works)
            self.max_scale_mul = torch.log(torch.tensor(100, device="cpu")).item()
        else:
            self.scale = 1 / math.sqrt(self.head_dim) / tau
        self.mat_qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(embed_dim))
        self.v_bias = nn.Parameter(torch.zeros(embed_dim))
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.caching, self.cached_k, self.cached_v = False, None, None

    def kv_caching(self, enable: bool) -> None:
        self.caching, self.cached_k, self.cached_v = enable, None, None

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None) -> torch.Tensor:
        B, L, C = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv = F.linear(x, self.mat_qkv.weight, bias).view(B, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(dim=0)  # each B H L c
        if self.cos_attn:
            scale_mul = self.scale_mul_1H11.clamp_max(self.max_scale_mul).exp()
            q = F.normalize(q, dim=-1).mul(scale_mul)
            k = F.normalize(k, dim=-1).to(q.dtype)

        observer = getattr(self, "mmkv_observer", None)  # set by `mmkv.inspect.KVObserver.attach`; reads only
        if observer is not None and self.caching:
            observer(self.mmkv_layer, "commit", q, k, k, v)  # every cached AR step commits one scale; no RoPE
        store = getattr(self, "mmkv_store", None)
        if self.caching and store is not None:
            # One AR step = one scale = one store unit; the store keeps the residual window native and serves
            # attention over [stored units | current scale] (the current scale was just appended).
            store.append(self.mmkv_layer, k, v, num_units=1)
            out = store.attend(self.mmkv_layer, q, scale=self.scale)
        else:
            if self.caching:
                if self.cached_k is None:
                    self.cached_k, self.cached_v = k, v
                else:
                    k = self.cached_k = torch.cat((self.cached_k, k), dim=2)
                    v = self.cached_v = torch.cat((self.cached_v, v), dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(B, L, C))


class AdaLNSABlock(nn.Module):
    """x += g1 * Attn(LN(x)(1+s1)+b1); x += g2 * FFN(LN(x)(1+s2)+b2), with (g1,g2,s1,s2,b1,b2) = ada_lin(cond)."""

    def __init__(self, block_idx: int, embed_dim: int, cond_dim: int, num_heads: int, mlp_ratio: float,
                 norm_eps: float, tau: float, cos_attn: bool):
        super().__init__()
        self.block_idx, self.C, self.D = block_idx, embed_dim, cond_dim
        self.attn = SelfAttention(block_idx, embed_dim, num_heads, tau=tau, cos_attn=cos_attn)
        self.ffn = FFN(embed_dim, round(embed_dim * mlp_ratio))
        self.ln_wo_grad = nn.LayerNorm(embed_dim, eps=norm_eps, elementwise_affine=False)
        self.ada_lin = nn.Sequential(nn.SiLU(inplace=False), nn.Linear(cond_dim, 6 * embed_dim))

    def forward(self, x: torch.Tensor, cond_BD: torch.Tensor, attn_bias: torch.Tensor | None) -> torch.Tensor:
        gamma1, gamma2, scale1, scale2, shift1, shift2 = self.ada_lin(cond_BD).view(-1, 1, 6, self.C).unbind(2)
        x = x + self.attn(self.ln_wo_grad(x).mul(scale1.add(1)).add_(shift1), attn_bias=attn_bias).mul_(gamma1)
        x = x + self.ffn(self.ln_wo_grad(x).mul(scale2.add(1)).add_(shift2)).mul(gamma2)
        return x


class AdaLNBeforeHead(nn.Module):
    def __init__(self, C: int, D: int, norm_eps: float):
        super().__init__()
        self.C, self.D = C, D
        self.ln_wo_grad = nn.LayerNorm(C, eps=norm_eps, elementwise_affine=False)
        self.ada_lin = nn.Sequential(nn.SiLU(inplace=False), nn.Linear(D, 2 * C))

    def forward(self, x_BLC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada_lin(cond_BD).view(-1, 1, 2, self.C).unbind(2)
        return self.ln_wo_grad(x_BLC).mul(scale.add(1)).add_(shift)


class AAR(nn.Module):
    """The AAR transformer. The SAT is not a submodule (as upstream): pass it to `mmkv.pipelines.aar.sample`."""

    def __init__(self, cfg: AARConfig = AARConfig()):
        super().__init__()
        self.config = cfg
        C = D = cfg.embed_dim
        self.Cvae, self.V, self.C, self.D = cfg.cvae, cfg.vocab_size, C, D
        self.depth, self.num_heads = cfg.depth, cfg.num_heads
        self.patch_nums = tuple(cfg.patch_nums)
        self.L, self.first_l = cfg.L, cfg.patch_nums[0]
        self.num_stages_minus_1 = len(self.patch_nums) - 1
        if self.num_stages_minus_1 < 1:
            raise ValueError(f"AAR needs at least 2 scales, got patch_nums={self.patch_nums}")
        self.begin_ends = []
        cur = 0
        for pn in self.patch_nums:
            self.begin_ends.append((cur, cur + pn))
            cur += pn

        self.word_embed = nn.Linear(cfg.cvae, C)
        self.class_emb = MLP(cfg.input_dim, C, D)
        # The null condition is a random (1, 512) *buffer*, stored in the checkpoint: load it, never re-draw it.
        self.register_buffer("uncond_embedding", torch.zeros(1, 512))
        self.pos_start = nn.Parameter(torch.zeros(1, self.first_l, C))
        self.pos_1LC = nn.Parameter(torch.zeros(1, self.L, C))
        self.lvl_embed = nn.Embedding(len(self.patch_nums), C)
        self.shared_ada_lin = nn.Identity()  # shared_aln=False
        self.blocks = nn.ModuleList([
            AdaLNSABlock(i, C, D, cfg.num_heads, cfg.mlp_ratio, cfg.norm_eps, cfg.tau, cfg.cos_attn)
            for i in range(cfg.depth)
        ])
        # Level id of every token and the block-causal training mask (unused at inference; the cache gives the same
        # visibility). Both are persistent buffers in the checkpoint.
        d = torch.cat([torch.full((pn,), i) for i, pn in enumerate(self.patch_nums)]).view(1, self.L, 1)
        dT = d.transpose(1, 2)
        self.register_buffer("lvl_1L", dT[:, 0].contiguous())
        self.register_buffer(
            "attn_bias_for_masking", torch.where(d >= dT, 0.0, -torch.inf).reshape(1, 1, self.L, self.L).contiguous()
        )
        self.head_nm = AdaLNBeforeHead(C, D, cfg.norm_eps)
        self.head = nn.Linear(C, cfg.vocab_size)

    # -- inference pieces used by the rollout loop (mmkv.pipelines.aar.sample) ---------------------------------
    def kv_caching(self, enable: bool) -> None:
        for b in self.blocks:
            b.attn.kv_caching(enable)

    def get_logits(self, h: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_nm(h.float(), cond_BD).float()).float()

    def condition(self, label_B: torch.Tensor) -> torch.Tensor:
        """cond_BD (2B, D): rows 0..B-1 conditional, B..2B-1 the stored null condition (CFG)."""
        return self.class_emb(torch.cat((label_B, self.uncond_embedding.expand_as(label_B)), dim=0))

    def level_positions(self) -> torch.Tensor:
        return self.lvl_embed(self.lvl_1L) + self.pos_1LC

    def first_tokens(self, cond_BD: torch.Tensor, lvl_pos: torch.Tensor) -> torch.Tensor:
        B2 = cond_BD.shape[0]
        return (cond_BD.unsqueeze(1).expand(B2, self.first_l, -1) + self.pos_start.expand(B2, self.first_l, -1)
                + lvl_pos[:, : self.first_l])

    def step(self, x: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        """One AR step: the current scale's tokens (2B, pn, C) through every block, then the head -> fp32 logits."""
        for b in self.blocks:
            x = b(x=x, cond_BD=cond_BD, attn_bias=None)
        return self.get_logits(x, cond_BD)

    def forward(self, label_B: torch.Tensor, x_BLCv_wo_first_l: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, L, V) with the block-causal mask (no condition dropout; eval use)."""
        B = x_BLCv_wo_first_l.shape[0]
        sos = cond_BD = self.class_emb(label_B)
        sos = sos.unsqueeze(1).expand(B, self.first_l, -1) + self.pos_start.expand(B, self.first_l, -1)
        x = torch.cat((sos, self.word_embed(x_BLCv_wo_first_l.float())), dim=1)
        x = x + (self.lvl_embed(self.lvl_1L.expand(B, -1)) + self.pos_1LC)
        for b in self.blocks:
            x = b(x=x, cond_BD=cond_BD, attn_bias=self.attn_bias_for_masking)
        return self.get_logits(x, cond_BD)

    # -- random init (tests; real use loads a checkpoint) ------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, init_adaln: float = 0.5, init_adaln_gamma: float = 1e-5,
                     init_head: float = 0.02, init_std: float = -1.0) -> "AAR":
        """Upstream's constructor init plus `init_weights` (model/aar.py), drawn from a private generator.

        The builder's defaults nearly switch the residual branches off (gamma ~ 1e-5); tiny test models use
        init_adaln_gamma=1, init_head=1 so attention over the KV cache matters (AAR model/aar.py `init_weights`).
        """
        if init_std < 0:
            init_std = (1 / self.C / 3) ** 0.5
        tn = lambda t, std: nn.init.trunc_normal_(t, std=std, generator=generator)  # noqa: E731
        self.uncond_embedding.copy_(torch.randn(1, 512, generator=generator) / 512**0.5)
        tn(self.pos_start, init_std)
        tn(self.pos_1LC, init_std)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                tn(m.weight, init_std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                tn(m.weight, init_std)
        for b in self.blocks:
            if b.attn.cos_attn:
                b.attn.scale_mul_1H11.copy_(torch.full_like(b.attn.scale_mul_1H11, 4.0).log())
            b.attn.q_bias.zero_()
            b.attn.v_bias.zero_()
            b.attn.zero_k_bias.zero_()
            b.attn.proj.weight.div_(math.sqrt(2 * self.depth))
            b.ffn.fc2.weight.div_(math.sqrt(2 * self.depth))
            b.ada_lin[-1].weight[2 * self.C:].mul_(init_adaln)
            b.ada_lin[-1].weight[: 2 * self.C].mul_(init_adaln_gamma)
            b.ada_lin[-1].bias.zero_()
        self.head.weight.mul_(init_head)
        self.head.bias.zero_()
        self.head_nm.ada_lin[-1].weight.mul_(init_adaln)
        self.head_nm.ada_lin[-1].bias.zero_()
        self._reset_static_buffers()
        return self

    def _reset_static_buffers(self) -> None:
        d = torch.cat([torch.full((pn,), i) for i, pn in enumerate(self.patch_nums)]).view(1, self.L, 1)
        dT = d.transpose(1, 2)
        self.lvl_1L.copy_(dT[:, 0])
        self.attn_bias_for_masking.copy_(torch.where(d >= dT, 0.0, -torch.inf).reshape(1, 1, self.L, self.L))


def build_aar(cfg: AARConfig, device: torch.device | str = "meta") -> AAR:
    """An AAR whose tensors live on `device`; the default `meta` allocates nothing (for `load_state_dict(assign=True)`)."""
    with torch.device(device):
        return AAR(cfg)

"""OCTOPUS: rotated keys quantised in octahedral triplets (OCTOPUS paper, section 3).

A key k becomes its norm gamma = ||k|| and the unit vector u = H(s * k/gamma) (one sign vector per layer and KV head).
u is zero-padded to 3*ceil(d/3) and split into contiguous triplets t_i; each triplet splits into its norm rho_i and a
direction folded onto the square by the standard octahedral map (xi, eta). xi and eta share one Lloyd-Max codebook of
`dir` bits, rho gets its own `rho`-bit codebook; by default (dir, rho) = (b+1, b-1), i.e. 3b+1 bits per triplet. Both
codebooks are trained on "implementation-matched" marginals: samples pushed through this exact pipeline, padding
included (OCTOPUS paper, section 3.4). The optional joint 3x3 rounding (section 3.5, eq. 12) only changes the encoder.

Stored per row of T tokens (planar, each plane one dense bit stream over T*n_t codes, `mmkv.codecs.packing`):
  `dir`   one 2*dir-bit code per triplet, jx in the low bits and jy in the high bits (= the kernel's LUT index),
  `rho`   one rho-bit code per triplet (absent when rho = 0 bits: rho is then the constant E[rho]),
  `gamma` the key norm, fp32 (default) or fp16.
Attention can score in the rotated domain: score = gamma * <H(s*q), u_hat> (paper eq. 13), see `rotate_query` and
`decode_rotated`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mmkv.codecs import codebooks
from mmkv.codecs.base import Codec, CodecError, Encoded, derive_seed
from mmkv.codecs.checks import check_or_defer
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.lloyd import lloyd_max
from mmkv.codecs.packing import pack_bits, unpack_bits
from mmkv.codecs.rotation import RandomizedHadamard

# ε-safe divisor for zero keys and zero triplets (a zero norm would divide by zero).
_EPS = 1e-30

# ----------------------------------------------------------------------------------------------------------------
# The octahedral map (OCTOPUS paper, eqs. 5-6), standard non-equal-area form, sgn(0) = +1.


def _sgn(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 0, torch.ones_like(v), -torch.ones_like(v))


def oct_encode(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t[..., 3] (any scale, zero allowed) -> (xi, eta) in [-1, 1]^2; the top hemisphere lands in the diamond."""
    x, y, z = t.unbind(-1)
    ell = (x.abs() + y.abs() + z.abs()).clamp_min(_EPS)  # explicit sums: same bits on every CPU (no SIMD reductions)
    px, py, pz = x / ell, y / ell, z / ell
    top = pz >= 0
    xi = torch.where(top, px, (1 - py.abs()) * _sgn(px))
    eta = torch.where(top, py, (1 - px.abs()) * _sgn(py))
    return xi, eta


def oct_decode(xi: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """(xi, eta) -> unit vector [..., 3]; the inverse of `oct_encode` on the sphere."""
    z = 1 - xi.abs() - eta.abs()
    bottom = z < 0
    x = torch.where(bottom, (1 - eta.abs()) * _sgn(xi), xi)
    y = torch.where(bottom, (1 - xi.abs()) * _sgn(eta), eta)
    norm = torch.sqrt(x * x + y * y + z * z).clamp_min(_EPS)
    return torch.stack((x / norm, y / norm, z / norm), dim=-1)


def triplet_norm(t: torch.Tensor) -> torch.Tensor:
    x, y, z = t.unbind(-1)
    return torch.sqrt(x * x + y * y + z * z)


def n_triplets(d: int) -> int:
    return -(-d // 3)


# ----------------------------------------------------------------------------------------------------------------
# Codebooks: implementation-matched marginals (OCTOPUS paper, section 3.4; docs/decisions.md, OCTOPUS codebooks)

CODEBOOK_DIMS = (16, 32, 64, 128, 256)
XI_BITS = tuple(range(1, 8))  # direction bits per octahedral coordinate
RHO_BITS = tuple(range(0, 7))  # triplet-norm bits; 0 bits = the constant E[rho]
_CODEBOOK_SEED = 20260521
_KEY = re.compile(r"^d(\d+)_(xi|rho)(\d+)$")


def training_vectors(d: int) -> int:
    """Unit vectors sampled per head dim: 100k up to d = 128, then 12.8M coordinates' worth (50k at d = 256).

    At d = 128 that is 4.3M triplets (8.6M pooled xi/eta samples), enough for centroids to ~1e-4 while the whole
    family builds in seconds on one core.
    """
    return min(100_000, 12_800_000 // d)


@functools.lru_cache(maxsize=1)
def marginal_samples(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted pooled (xi and eta) and rho samples for head dim d: random unit vectors -> zero pad -> contiguous
    triplets -> octahedral fold, exactly the encoder's path. For Gaussian vectors the rotation changes nothing, so
    the vectors are drawn on the sphere directly (float64, seeded numpy generator)."""
    rng = np.random.Generator(np.random.PCG64(derive_seed(_CODEBOOK_SEED, "octopus-codebook", d)))
    n_t, pad = n_triplets(d), 3 * n_triplets(d) - d
    xis, rhos = [], []
    remaining = training_vectors(d)
    while remaining > 0:
        n = min(remaining, 20_000)
        remaining -= n
        g = rng.standard_normal((n, d))
        sq = np.zeros(n)
        for j in range(d):  # a fixed summation order, so the file rebuilds bit-identically on any IEEE machine
            sq = sq + g[:, j] * g[:, j]
        u = g / np.sqrt(sq)[:, None]
        t = torch.from_numpy(np.pad(u, ((0, 0), (0, pad)))).view(n, n_t, 3)
        xi, eta = oct_encode(t)
        xis += [xi.numpy().ravel(), eta.numpy().ravel()]
        rhos.append(triplet_norm(t).numpy().ravel())
    return np.sort(np.concatenate(xis)), np.sort(np.concatenate(rhos))


def codebook_keys(dims=CODEBOOK_DIMS) -> list[str]:
    """Shipped keys, grouped by d so that one d's samples are drawn once per build."""
    return [k for d in dims for k in [f"d{d}_xi{b}" for b in XI_BITS] + [f"d{d}_rho{b}" for b in RHO_BITS]]


@codebooks.codebook_family("octopus", keys=codebook_keys())
def octopus_codebook(key: str) -> list[float]:
    """`d{d}_xi{bits}` (C_xi, 2**bits sorted centroids on [-1, 1]) or `d{d}_rho{bits}` (C_rho on [0, 1]; 0 bits gives
    the single value E[rho] of the pooled samples, which is what 1-level Lloyd-Max converges to)."""
    m = _KEY.match(key)
    if not m:
        raise KeyError(f"bad octopus codebook key {key!r}; expected e.g. 'd128_xi3' or 'd128_rho1'")
    d, kind, bits = int(m.group(1)), m.group(2), int(m.group(3))
    if d < 4 or d & (d - 1) or bits > 8:
        raise KeyError(f"octopus codebook key {key!r}: need a power-of-two d >= 4 and at most 8 bits")
    xi, rho = marginal_samples(d)
    # Not symmetrised: at d mod 3 = 1 the padded triplet's point masses make the optimum asymmetric (paper section 3.4).
    return lloyd_max(xi if kind == "xi" else rho, 2**bits, iters=300, tol=1e-10).tolist()


# ----------------------------------------------------------------------------------------------------------------
# The codec


@dataclass(frozen=True)
class OctopusConfig(CodecConfig):
    """bits (nominal 1..5), joint (0/1: the joint 3x3 rounding), norm (32 or 16 bits for gamma), dir and rho ("auto"
    or bits per octahedral coordinate / triplet norm).

    dir = "auto" means bits+1 per octahedral coordinate, rho = "auto" means bits-1 for the triplet norm; give integers
    for the App. D sweep (b+delta, b-delta). bits itself only sets those defaults and the paired V codec's bits.
    """

    name: ClassVar[str] = "octopus"
    aliases: ClassVar[dict[str, str]] = {"b": "bits"}
    printed: ClassVar[dict[str, str]] = {"bits": "b"}
    bits: int = 3
    joint: int = 1
    norm: int = 32
    dir: int | str = "auto"
    rho: int | str = "auto"

    def __post_init__(self) -> None:
        self.check_choice("bits", (1, 2, 3, 4, 5))
        if isinstance(self.joint, bool):  # `joint=true` reads as 1
            self.set("joint", int(self.joint))
        self.check_choice("joint", (0, 1))
        self.check_choice("norm", (16, 32))
        if self.dir != "auto":
            self.check_choice("dir", XI_BITS)
        if self.rho != "auto":
            self.check_choice("rho", RHO_BITS)


class OctopusCodec(Codec):
    """OCTOPUS keys (parameters: `OctopusConfig`)."""

    config_class = OctopusConfig
    display_name = "OCTOPUS"
    token_local = True  # each token encoded on its own (CacheConfig.merge_units)
    bit_streams = ("dir", "rho")
    requires_pow2 = True
    rotation_stream = "octopus"

    def setup(self) -> None:
        cfg = self.config
        self.bits, self.joint, self.norm_bits = cfg.bits, bool(cfg.joint), cfg.norm
        self.dir_bits = self.bits + 1 if cfg.dir == "auto" else cfg.dir
        self.rho_bits = self.bits - 1 if cfg.rho == "auto" else cfg.rho
        d = self.head_dim
        if d < 4:
            raise CodecError(f"codec {self.name!r}: head_dim must be >= 4 (one full triplet), got {d}")
        self.n_t = n_triplets(d)
        self.pad = 3 * self.n_t - d
        self.rotation = RandomizedHadamard(
            d, num_heads=self.num_heads, seed=self.seed, layer=self.layer, stream=self.rotation_stream
        )
        self.xi_codebook = codebooks.load("octopus", f"d{d}_xi{self.dir_bits}")
        self.rho_codebook = codebooks.load("octopus", f"d{d}_rho{self.rho_bits}")
        # Decode LUT of unit directions, index jx + (jy << dir) (see docs/decisions.md); float64 then fp32.
        c = self.xi_codebook.double()
        levels = c.numel()
        self.dir_lut = oct_decode(c.repeat(levels), c.repeat_interleave(levels)).float()  # [L*L, 3]
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    # -- helpers -----------------------------------------------------------------------------------------------
    def _on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(xi centroids, xi boundaries, rho centroids, rho boundaries, direction LUT) on `device`."""
        if device not in self._tables:
            xi = self.xi_codebook.to(device)
            rho = self.rho_codebook.to(device)
            self._tables[device] = (xi, 0.5 * (xi[1:] + xi[:-1]), rho, 0.5 * (rho[1:] + rho[:-1]), self.dir_lut.to(device))
        return self._tables[device]

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """q' = H(s * q) per KV head (fp32). With GQA fold each KV head's query group into the token axis:
        q[..., H_kv, G*Tq, D]."""
        return self.rotation.forward(q.float())

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse rotation s * H(y), e.g. for values accumulated in the rotated domain (the rotation is linear)."""
        return self.rotation.inverse(y.float())

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x[..., T, D] fp32 -> (gamma[..., T], u[..., T, D] unit rotated keys, dir codes and rho codes [..., T, n_t])."""
        xi_c, xi_t, rho_c, rho_t, lut = self._on(x.device)
        gamma = x.norm(dim=-1)  # OCTOPUS paper, eq. 1
        u = self.rotation.forward(x / gamma.clamp_min(_EPS).unsqueeze(-1))  # step 2
        t = torch.nn.functional.pad(u, (0, self.pad)).unflatten(-1, (self.n_t, 3))  # step 3
        xi, eta = oct_encode(t)  # steps 4-5 (the fold is scale-free, so t need not be normalised)
        jx = torch.searchsorted(xi_t, xi.contiguous())  # step 6: nearest centroid, ties to the lower index
        jy = torch.searchsorted(xi_t, eta.contiguous())
        if self.joint:  # step 7: best of the 3x3 neighbours by s = <t, n_hat>, rho then quantised from s
            levels = xi_c.numel()
            delta = torch.tensor([-1, 0, 1], device=x.device)
            cx = (jx.unsqueeze(-1) + delta.repeat_interleave(3)).clamp(0, levels - 1)  # dx outer, dy inner:
            cy = (jy.unsqueeze(-1) + delta.repeat(3)).clamp(0, levels - 1)  # candidates in ascending (jx, jy)
            s = (lut[cx + cy * levels] * t.unsqueeze(-2)).sum(-1)
            best = s.argmax(-1, keepdim=True)  # first maximum = lower index on ties
            jx, jy = cx.gather(-1, best).squeeze(-1), cy.gather(-1, best).squeeze(-1)
            r = s.gather(-1, best).squeeze(-1)
        else:
            r = triplet_norm(t)
        jr = torch.searchsorted(rho_t, r.contiguous())
        return gamma, u, jx + (jy << self.dir_bits), jr

    def _unit_from_codes(self, code: torch.Tensor, jr: torch.Tensor) -> torch.Tensor:
        """Codes [..., T, n_t] -> u_hat[..., T, D] (padding dropped), fp32."""
        _, _, rho_c, _, lut = self._on(code.device)
        t_hat = lut[code] * rho_c[jr].unsqueeze(-1)
        return t_hat.flatten(-2)[..., : self.head_dim]

    def _pack_rows(self, codes: torch.Tensor, width: int) -> torch.Tensor:
        return pack_bits(codes.flatten(-2), width)  # one dense stream over T * n codes per row

    def _unpack_rows(self, enc: Encoded, key: str, width: int, n: int) -> torch.Tensor:
        T = enc.shape[-2]
        return unpack_bits(enc.tensors[key], width, T * n).unflatten(-1, (T, n))

    def _store_gamma(self, gamma: torch.Tensor) -> torch.Tensor:
        """Norms as stored: fp32, or fp16 after checking they fit (read now, or collected by the active scope: see
        `mmkv.codecs.checks`)."""
        if self.norm_bits == 32:
            return gamma.float()
        if gamma.numel():
            def message() -> str:
                return f"codec {self.config}: key norm {float(gamma.max()):g} overflows the fp16 gamma; use norm=32"

            check_or_defer(gamma.max() > 65504.0, message)
        return gamma.half()

    # -- protocol ----------------------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> Encoded:
        gamma, _, code, jr = self._quantize(x)
        return Encoded(str(self.config), tuple(x.shape), x.dtype, self._pack(gamma, code, jr), {"n_t": self.n_t})

    def _pack(self, gamma: torch.Tensor, code: torch.Tensor, jr: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = {"dir": self._pack_rows(code, 2 * self.dir_bits), "gamma": self._store_gamma(gamma)}
        if self.rho_bits:
            tensors["rho"] = self._pack_rows(jr, self.rho_bits)
        return tensors

    def _rotated_unit(self, enc: Encoded) -> torch.Tensor:
        """u_hat (what the stored codes say about the rotated unit key), [..., T, D] fp32."""
        code = self._unpack_rows(enc, "dir", 2 * self.dir_bits, self.n_t)
        if self.rho_bits:
            jr = self._unpack_rows(enc, "rho", self.rho_bits, self.n_t)
        else:
            jr = torch.zeros_like(code)
        return self._unit_from_codes(code, jr)

    def _check(self, enc: Encoded) -> None:
        if enc.codec != str(self.config):
            raise CodecError(f"cannot decode data encoded by {enc.codec!r} with codec {self.config}")

    def decode_rotated(self, enc: Encoded) -> torch.Tensor:
        """gamma * u_hat in the rotated domain, [..., T, D] fp32: score = <rotate_query(q), decode_rotated(enc)>."""
        self._check(enc)
        return enc.tensors["gamma"].float().unsqueeze(-1) * self._rotated_unit(enc)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return self.rotation.inverse(self.decode_rotated(enc))  # k_hat = gamma * s * H(u_hat), OCTOPUS paper, eq. 6

    def scores(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """q·k_hat computed as the fused kernel does: rotate q once, never rotate keys back (OCTOPUS paper, eq. 13)."""
        self._check(enc)
        return torch.matmul(self.rotate_query(q), self.decode_rotated(enc).transpose(-1, -2))

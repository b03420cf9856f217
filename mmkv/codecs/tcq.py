"""TCQ: rotated keys or values quantised by a bitshift trellis (QTIP: Tseng, Sun, Hou, De Sa, NeurIPS 2024).

A vector x becomes the rotated vector r = H(s * x) (one sign vector per layer and KV head) and the unit-variance
vector u = r * sqrt(d) / ||x||, whose coordinates are close to N(0, 1). u is cut into d / 2 steps of V = 2 values.
The encoder walks a trellis of S = 2^L states: step t appends k_t bits to the state, s_t = ((s_{t-1} << k_t) | c_t)
mod S (QTIP's "bitshift trellis"), so a code is the bit string itself and state s reconstructs the V
values `table[s]`. A Viterbi pass picks the bit string of least squared error ||u - table[s_1..s_T]||^2. The trellis
is tail-biting: the first state's high bits are the last state's low bits, so no bits are spent on a start state. It
is found with two passes: a free one over the steps around the first (rotated so that the first sits in the middle),
whose state at the first step fixes the overlap bits h, and one constrained to start and end with h (`viterbi`).

Rate: k = 2 * bits bits a step; `hi` of the d / 2 steps (spread evenly) take k + 1 bits, so that the codec can sit at
any other codec's effective bits: `tcq:bits=2,hi=64` is 2.5 bits a coordinate at d = 128, and
`tcq:bits=2,hi=45,norm=32` spends OCTOPUS b=2's 333 bits per vector.

Table: fixed per (L, k, V), data-oblivious and seeded: N(0, 1) draws refined by a few Lloyd iterations on N(0, 1)
training vectors (assign by Viterbi, replace each entry by the mean of the values it reconstructed), a stored
table where QTIP computes its codes from the state. The steps at k + 1 bits use the same table.

Gain: alpha = <r, u_hat> / ||u_hat||^2, the least-squares scale of the decoded u_hat, stored in fp16 or fp32;
decode is x_hat = s * H(alpha * u_hat). Stored per row of T tokens (each plane one dense bit stream over the row's
T * steps codes, `mmkv.codecs.packing`):
  `code`     the low k bits of every step's code,
  `code_hi`  the extra bit of the `hi` wide steps (absent when hi = 0),
  `gain`     alpha, fp16 (default) or fp32.
Bits per vector: k * d / 2 + hi + 16 (or + 32). Scores can be computed in the rotated domain, <H(s * q), alpha *
u_hat>, see `rotate_query` and `decode_rotated`.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from mmkv.codecs import codebooks
from mmkv.codecs.base import Codec, CodecError, Encoded, private_generator
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.packing import pack_bits, unpack_bits
from mmkv.codecs.rotation import RandomizedHadamard
from mmkv.codecs.turboquant_mse import store_norm

V = 2  # values a trellis step reconstructs
STATE_BITS = tuple(range(4, 17))  # L; the encoder's work grows as 2^L
BITS = (1, 2, 3, 4, 5)  # payload bits a coordinate: k = 2 * bits bits a step (halves and between: `hi`)
# The default L at each width: the smallest L at which TCQ's MSE is at least 25% below OCTOPUS's, with and without
# OCTOPUS's joint rounding (fp32 norms on both sides), at OCTOPUS's effective bits of that width, on the synthetic
# bench's 8 seeds of 1024 N(0, I) keys at d = 128 (docs/decisions.md, "Default L by width"; docs/perf.md): L = 8 at
# b = 2 (-36% / -31%); L = 9 at b = 3 (L = 8 is -27% / -22%); L = 11 at b = 4 (L = 10 is -25% / -20%). The
# encoder's work is 2^L, so 2 bits encode 8x and 3 bits 4x faster than at L = 11. 1 bit takes 2's; 5 bits (10-bit
# steps) need L >= 11.
DEFAULT_L = {1: 8, 2: 8, 3: 9, 4: 11, 5: 11}

# -- the table ---------------------------------------------------------------------------------------------------

_TABLE_SEED = 20261201
TRAIN_VECTORS = 2048  # N(0, 1) training vectors of 64 steps (d = 128) for the table's Lloyd iterations
TRAIN_ITERS = 4
_INF = float("inf")


def hi_steps(steps: int, hi: int) -> list[bool]:
    """Which of `steps` steps take one extra bit: `hi` of them, spread evenly (step t is wide when floor((t+1) hi / T)
    passes an integer)."""
    return [((t + 1) * hi) // steps > (t * hi) // steps for t in range(steps)]


def step_widths(steps: int, k: int, hi: int) -> list[int]:
    return [k + w for w in hi_steps(steps, hi)]


def _distances(ut: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Squared distances of one step's values to every table row -> [N, S], summed over V in order (the Triton
    encoder adds in the same order). ut [V, N] and table [V, S] are given value by value, each row contiguous, so that
    the broadcast differences vectorise (strided [N, V] / [S, V] columns made `torch.sub` 2.2x slower, the whole CPU
    Viterbi 1.4x, docs/perf.md "Demo"); the arithmetic is the same. `out` / `scratch`: [N, S] buffers of the result's
    dtype to compute in (the result is `out`), so that a trellis pass allocates nothing a step; each value is the same
    difference, square and sum."""
    d = torch.sub(ut[0][:, None], table[0][None, :], out=out)
    d.mul_(d)
    for v in range(1, table.shape[0]):
        e = torch.sub(ut[v][:, None], table[v][None, :], out=scratch)
        d.add_(e.mul_(e))
    return d


def _trellis_pass(u: torch.Tensor, table: torch.Tensor, widths: list[int], L: int, h: torch.Tensor | None,
                  keep: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Viterbi over u [N, T, V]: (the least squared error of a path ending in each state [N, S], back-pointers).

    The predecessors of state s under a k-bit step are the 2^k states (j << (L - k)) | (s >> k); viewing the costs as
    [2^k, S / 2^k] puts them in one column. h [N]: the first state must start with the bits h (tail-biting); the
    back-pointer of step t is the j of each column (ties: the lowest j), [N, S / 2^k]. The costs live in two [N, S]
    buffers used in turn (and a third for the distances' terms): a fresh 4 MB tensor a step cost the CPU a page
    fault a 4 KB page wherever the allocator hands large blocks back to the system (up to 6.7x slower at L = 10 on
    two threads, docs/perf.md "Demo")."""
    n, steps, S = u.shape[0], u.shape[1], 1 << L
    dtype = torch.promote_types(u.dtype, table.dtype)
    bufs = [torch.empty(n, S, dtype=dtype, device=u.device) for _ in range(3)]
    ut = u.permute(1, 2, 0).contiguous()  # [T, V, N]: each step's values row by row
    rows = table.t().contiguous()  # [V, S]
    cost = _distances(ut[0], rows, bufs[0], bufs[2])
    if h is not None:
        first = torch.arange(S, device=u.device) >> widths[0]
        cost.masked_fill_(first[None] != h[:, None], _INF)
    back = []
    for t in range(1, steps):
        k = widths[t]
        best, arg = cost.view(n, 1 << k, S >> k).min(dim=1)
        cost = _distances(ut[t], rows, bufs[t % 2], bufs[2])
        cost.view(n, S >> k, 1 << k).add_(best.unsqueeze(-1))
        if keep:
            back.append(arg.to(torch.int16))
    return cost, back


def _backtrack(state: torch.Tensor, back: list[torch.Tensor], widths: list[int], L: int) -> torch.Tensor:
    """The states [N, T] of the best path ending in `state` [N], read back through the back-pointers."""
    states = [state]
    for t in range(len(widths) - 1, 0, -1):
        k = widths[t]
        j = back[t - 1].gather(1, (state >> k).unsqueeze(-1)).squeeze(-1).to(torch.int64)
        state = (j << (L - k)) | (state >> k)
        states.append(state)
    return torch.stack(states[::-1], dim=1)


# Pass one of `viterbi` looks this many steps either side of the first step (docs/decisions.md, "TCQ's first pass").
PASS_ONE_WINDOW = 16


def pass_one_window(steps: int, window: int | None = PASS_ONE_WINDOW) -> tuple[int, int]:
    """(roll, length) of `viterbi`'s pass one: it runs over `length` steps taken from (t - roll) mod steps, so that
    the first step is at position `roll`. All steps rotated by half their number up to 2 * window steps (and for
    window None, QTIP's), the `window` steps either side of the first beyond."""
    if window is not None and window < 1:
        raise ValueError(f"tcq: pass one's window must be a positive number of steps or None (all), got {window}")
    if window is None or steps <= 2 * window:
        return steps // 2, steps
    return window, 2 * window


def viterbi(u: torch.Tensor, table: torch.Tensor, widths: list[int], L: int, *,
            window: int | None = PASS_ONE_WINDOW) -> torch.Tensor:
    """The tail-biting bit string of least squared error for u [N, T, V]: codes [N, T] (int64, step t's k_t bits).

    Pass one runs free with the first step in the middle of the steps it sees, far from the ends a free run gets
    wrong; the high L - k_1 bits h of its state there are what the first state must start with. QTIP's `quantize`
    (Cornell-RelaxML/qtip lib/codebook/bitshift.py) runs it over all T steps rotated by T / 2; here it sees at most
    the `window` = 16 steps either side (`pass_one_window`), which at d = 128 makes the search 96 steps a vector
    instead of 128 for a path error 0.05% higher at L = 8 and under 0.005% at L >= 9 (docs/decisions.md); `window`
    None is QTIP's pass, with which the shipped tables were trained (`tcq_table`). Pass two starts from states
    beginning with h and ends in a state ending with h; ties go to the lowest state."""
    n, steps = u.shape[0], u.shape[1]
    if n == 0:
        return torch.zeros(0, steps, dtype=torch.int64, device=u.device)
    S, low = 1 << L, (1 << (L - widths[0])) - 1
    roll, length = pass_one_window(steps, window)
    rolled = [widths[(t - roll) % steps] for t in range(length)]
    cost, back = _trellis_pass(torch.roll(u, roll, dims=1)[:, :length], table, rolled, L, None, keep=True)
    h = _backtrack(cost.argmin(dim=-1), back, rolled, L)[:, roll] >> widths[0]
    cost, back = _trellis_pass(u, table, widths, L, h, keep=True)
    ends = (torch.arange(S, device=u.device) & low)[None] == h[:, None]
    end = torch.where(ends, cost, torch.full_like(cost, _INF)).argmin(dim=-1)
    mask = torch.tensor([(1 << k) - 1 for k in widths], device=u.device)
    return _backtrack(end, back, widths, L) & mask


def lookback(widths: list[int], L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, shift) [J, steps] int32: the state of step t is OR_j code[src[j, t]] << shift[j, t], masked to L bits,
    over the J most recent steps (circularly) that hold its bits. Unused slots read step 0 shifted by 31, past any
    state's bits. The parts of one state occupy disjoint bits (each code is shifted by the widths of the steps after
    it), so the OR is also a sum. Built once a process for each (widths, L): read only."""
    return _lookback(tuple(widths), L)


@functools.lru_cache(maxsize=None)
def _lookback(widths: tuple[int, ...], L: int) -> tuple[torch.Tensor, torch.Tensor]:
    steps = len(widths)
    rows: list[tuple[list[int], list[int]]] = []
    for t in range(steps):
        src, shift, bits, j = [], [], 0, 0
        while bits < L:
            src.append((t - j) % steps)
            shift.append(bits)
            bits += widths[(t - j) % steps]
            j += 1
        rows.append((src, shift))
    J = max(len(s) for s, _ in rows)
    src = torch.zeros(J, steps, dtype=torch.int32)
    shift = torch.full((J, steps), 31, dtype=torch.int32)
    for t, (s, h) in enumerate(rows):
        src[: len(s), t] = torch.tensor(s, dtype=torch.int32)
        shift[: len(h), t] = torch.tensor(h, dtype=torch.int32)
    return src, shift


@functools.lru_cache(maxsize=None)
def _lookback_on(widths: tuple[int, ...], L: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src, shift = lookback(list(widths), L)
    return src.T.contiguous().to(device=device, dtype=torch.int64), shift.T.contiguous().to(device=device,
                                                                                           dtype=torch.int64)


def states_from_codes(codes: torch.Tensor, widths: list[int], L: int) -> torch.Tensor:
    """codes [..., T] -> the trellis states [..., T]: the last L bits of the circular bit string at each step.

    One gather of the J codes each state holds (`lookback`), shifted into place and summed (their bits are
    disjoint): a handful of tensor ops, where the step-by-step recurrence took three a step."""
    src, shift = _lookback_on(tuple(widths), L, codes.device)  # [T, J]
    return ((codes[..., src] << shift).sum(-1)) & ((1 << L) - 1)


# Shipped tables (`mmkv codebooks build`): the default L at every width the bench runs, L = 11 at 2 and 3 bits (the
# default before the widths had their own, and the first GPU figures' L) and L = 10 at 4 bits (the trained demo's
# 4-bit preset, mmkv/demo.py); any
# other (L, k) is trained on first use (seconds at L = 8, half a minute at L = 11, about 100 s at L = 12) and kept
# for the process.
SHIPPED = sorted({f"L{DEFAULT_L[b]}_k{2 * b}" for b in (2, 3, 4)} | {"L11_k4", "L11_k6", "L10_k8"})
_KEY = re.compile(r"^L(\d+)_k(\d+)$")


@codebooks.codebook_family("tcq", keys=SHIPPED)
def tcq_table(key: str) -> list[float]:
    """`L{L}_k{k}`: the [2^L, V] table for L state bits and k-bit steps, flattened: seeded N(0, 1) draws, then
    `TRAIN_ITERS` Lloyd iterations on `TRAIN_VECTORS` seeded N(0, 1) vectors of 64 steps (each entry becomes the mean
    of the values its state reconstructed under tail-biting Viterbi, pass one over all steps as QTIP's; an entry no
    path used keeps its value). Every step is elementwise IEEE arithmetic, a min or a sequential float64 sum, so it
    rebuilds within the codebooks' tolerance on any machine."""
    m = _KEY.match(key)
    if not m:
        raise KeyError(f"bad tcq table key {key!r}; expected e.g. 'L10_k4'")
    L, k = int(m.group(1)), int(m.group(2))
    if L not in STATE_BITS or not 1 <= k <= L:
        raise KeyError(f"tcq table key {key!r}: need L in {STATE_BITS[0]}..{STATE_BITS[-1]} and 1 <= k <= L")
    g = private_generator(_TABLE_SEED, "tcq-table", L, k)
    S = 1 << L
    table = torch.randn(S, V, generator=g, dtype=torch.float64)
    train = torch.randn(TRAIN_VECTORS, 64, V, generator=g, dtype=torch.float64).float()
    values = train.reshape(-1, V).double()
    widths = [k] * 64
    for _ in range(TRAIN_ITERS):
        states = torch.cat([states_from_codes(viterbi(part, table.float(), widths, L, window=None), widths, L)
                            for part in train.split(_chunk(L), dim=0)]).reshape(-1)
        count = torch.bincount(states, minlength=S).double()
        sums = torch.stack([torch.bincount(states, weights=values[:, v], minlength=S) for v in range(V)], dim=-1)
        table = torch.where((count > 0)[:, None], sums / count.clamp_min(1)[:, None], table)
    return table.reshape(-1).tolist()


def trellis_table(L: int, k: int) -> torch.Tensor:
    """The float32 [2^L, V] table for L state bits and k-bit steps (shipped, or trained once per process)."""
    return codebooks.load("tcq", f"L{L}_k{k}").view(1 << L, V)


_TABLES_ON: dict = {}  # (L, k, device) -> the trellis table, ("wide", steps, hi, device) -> the wide steps


def _chunk(L: int) -> int:
    """Vectors per Viterbi call: 2^20 state costs at once (4 MB temporaries, cache-sized: 1.7x faster on one CPU core
    than 2^22 at L = 11; each vector's codes do not depend on the grouping)."""
    return max(1, (1 << 20) >> L)


# -- the codec ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TCQConfig(CodecConfig):
    """bits (payload bits a coordinate, 1..5: k = 2 * bits bits a step), hi (steps at k + 1 bits: hi / d more bits a
    coordinate), L (state bits, 4..16: the encoder's speed / quality dial; default `DEFAULT_L` of the width: 8 at 1
    and 2 bits, 9 at 3, 11 above), norm (16 or 32 bits for the gain)."""

    name: ClassVar[str] = "tcq"
    aliases: ClassVar[dict[str, str]] = {"b": "bits", "l": "L"}
    bits: int = 2
    hi: int = 0
    L: int | None = None
    norm: int = 16

    def __post_init__(self) -> None:
        self.check_choice("bits", BITS)
        if self.L is None:  # the width's default, written into the config (and its canonical string)
            self.set("L", DEFAULT_L[self.bits])
        self.check_int("hi", 0)
        self.check_choice("L", STATE_BITS)
        self.check_choice("norm", (16, 32))
        k = 2 * self.bits + (self.hi > 0)
        if k > self.L:
            self.fail(f"a step of {k} bits needs L >= {k} state bits, got L={self.L}")


class TCQCodec(Codec):
    """Rotated trellis-coded quantisation of keys or values (parameters: `TCQConfig`)."""

    config_class = TCQConfig
    display_name = "TCQ"
    token_local = True  # each token encoded on its own (CacheConfig.merge_units)
    bit_streams = ("code", "code_hi")
    requires_pow2 = True

    @classmethod
    def value_config(cls, config: CodecConfig, group: int = 32) -> CodecConfig:
        return config  # values are coded like keys: the trellis minimises squared error, what a value needs

    def setup(self) -> None:
        cfg = self.config
        d = self.head_dim
        if d < 2 * V:
            raise CodecError(f"codec {self.name!r}: head_dim must be >= {2 * V}, got {d}")
        self.steps = d // V
        self.k, self.hi, self.L, self.norm_bits = 2 * cfg.bits, cfg.hi, cfg.L, cfg.norm
        if self.hi > self.steps:
            raise CodecError(f"codec {cfg}: hi={self.hi} exceeds the {self.steps} trellis steps of head_dim {d}")
        self.widths = step_widths(self.steps, self.k, self.hi)
        if sum(self.widths) < self.L:
            raise CodecError(f"codec {cfg}: a {d}-dim vector holds {sum(self.widths)} code bits, fewer than the "
                             f"L={self.L} bits of one state; use a smaller L or more bits")
        self.wide = torch.tensor(hi_steps(self.steps, self.hi))
        self.rotation = RandomizedHadamard(d, num_heads=self.num_heads, seed=self.seed, layer=self.layer,
                                           stream="tcq")
        self.table = trellis_table(self.L, self.k)

    def _table_on(self, device: torch.device) -> torch.Tensor:
        """The table on `device`, one copy a process for each (L, k): a store builds a codec a layer and role, and
        each copy from host memory is a host sync on CUDA."""
        key = (self.L, self.k, torch.device(device))
        if key not in _TABLES_ON:
            _TABLES_ON[key] = self.table.to(device)
        return _TABLES_ON[key]

    def _wide_on(self, device: torch.device) -> torch.Tensor:
        """The wide steps' indices on `device`, made once: indexing with the bool mask `wide` asks the device how many
        are set (a host sync on CUDA) on every encode and decode."""
        key = ("wide", self.steps, self.hi, torch.device(device))
        if key not in _TABLES_ON:
            _TABLES_ON[key] = torch.nonzero(self.wide).flatten().to(device)
        return _TABLES_ON[key]

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """q' = H(s * q) per KV head (fp32)."""
        return self.rotation.forward(q.float())

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse rotation s * H(y), e.g. for values accumulated in the rotated domain."""
        return self.rotation.inverse(y.float())

    # -- encode ------------------------------------------------------------------------------------------------
    def unit_rotated(self, x: torch.Tensor, r: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, D] fp32 -> (r = H(s * x), u = r * sqrt(d) / ||x||), u's coordinates close to N(0, 1). `r`: the
        rotation already computed (the encode kernel's path rotates with the Hadamard kernel)."""
        r = self.rotation.forward(x) if r is None else r
        norm = x.norm(dim=-1, keepdim=True)
        u = r * (math.sqrt(self.head_dim) / torch.where(norm > 0, norm, torch.ones_like(norm)))
        return r, u

    def codes(self, u: torch.Tensor) -> torch.Tensor:
        """Unit-variance rotated vectors u [..., T, D] -> the Viterbi codes [..., T, steps] (int64)."""
        flat = u.reshape(-1, self.steps, V)
        table = self._table_on(u.device)
        parts = [viterbi(part, table, self.widths, self.L) for part in flat.split(_chunk(self.L), dim=0)]
        out = torch.cat(parts) if parts else flat.new_zeros(0, self.steps, dtype=torch.int64)
        return out.view(*u.shape[:-1], self.steps)

    def _encode(self, x: torch.Tensor) -> Encoded:
        r, u = self.unit_rotated(x)
        codes = self.codes(u)
        u_hat = self.unit_from_codes(codes)
        gain = (r * u_hat).sum(-1) / (u_hat * u_hat).sum(-1)  # least squares; ||u_hat|| > 0 for a trained table
        return Encoded(str(self.config), tuple(x.shape), x.dtype, self._pack(codes, gain))

    def _pack(self, codes: torch.Tensor, gain: torch.Tensor) -> dict[str, torch.Tensor]:
        # masked to their widths here, so packing need not scan them (a host sync on CUDA)
        tensors = {"code": pack_bits((codes & ((1 << self.k) - 1)).flatten(-2), self.k, in_range=True)}
        if self.hi:
            hi = (codes[..., self._wide_on(codes.device)] >> self.k) & 1
            tensors["code_hi"] = pack_bits(hi.flatten(-2), 1, in_range=True)
        tensors["gain"] = store_norm(gain, self.norm_bits, f"codec {self.config} (layer {self.layer})")
        return tensors

    # -- decode ------------------------------------------------------------------------------------------------
    def unpack_codes(self, enc: Encoded) -> torch.Tensor:
        """The stored codes [..., T, steps] (int64)."""
        self._check(enc)
        t = enc.shape[-2]
        codes = unpack_bits(enc.tensors["code"], self.k, t * self.steps).unflatten(-1, (t, self.steps))
        if self.hi:
            extra = unpack_bits(enc.tensors["code_hi"], 1, t * self.hi).unflatten(-1, (t, self.hi))
            codes[..., self._wide_on(codes.device)] |= extra << self.k
        return codes

    def unit_from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [..., T, steps] -> u_hat [..., T, D] fp32: one table row per step."""
        states = states_from_codes(codes, self.widths, self.L)
        return self._table_on(codes.device)[states].flatten(-2)

    def _check(self, enc: Encoded) -> None:
        if enc.codec != str(self.config):
            raise CodecError(f"cannot decode data encoded by {enc.codec!r} with codec {self.config}")

    def decode_rotated(self, enc: Encoded) -> torch.Tensor:
        """alpha * u_hat in the rotated domain, [..., T, D] fp32: score = <rotate_query(q), decode_rotated(enc)>."""
        return enc.tensors["gain"].float().unsqueeze(-1) * self.unit_from_codes(self.unpack_codes(enc))

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return self.rotation.inverse(self.decode_rotated(enc))  # x_hat = s * H(alpha * u_hat)

"""The KV statistics of `mmkv inspect kv` (kv_stats.json + kv_stats.png), per layer and head; the command line is
`mmkv.inspect`.

Which codec wins depends on the statistics of the cache it compresses; these are the ones the codec papers argue
from, measured over the committed K / V (the clean pass of every block, what later blocks read) of one rollout with
an uncompressed cache and global attention:

* key outlier channels (KIVI, Liu et al. 2024: keys are quantised per channel because a few channels are large):
  per-channel RMS over tokens, max / median over channels and the top-3 channels, before and after RoPE;
* value token-norm spread: max / median and p99 / median of per-token L2 norms;
* attention on the first block (the attention sink of StreamingLLM, Xiao et al. 2024): the softmax mass the queries of
  each later block put on the first block's keys, averaged, beside the uniform share (first-block keys / keys seen);
* token redundancy (Quant VideoGen's semantic-aware smoothing, Xi et al. 2026): k-means energy left after subtracting each token's
  centre, over the energy of the tokens, with QVG's own k-means (`mmkv.codecs.qvg.kmeans`, uniform init drawn with
  replacement from a fixed seed, bf16 centres);
* massive activations (Sun et al. 2024): the residual stream's max |x| / median |x| after each block, commit passes.

The collector, `KVObserver`, is model-agnostic: any attention module with an int `mmkv_layer` (the attribute
`KVStore.attach` uses) calls its `mmkv_observer(layer, mode, q, k_pre_rope, k_post_rope, v)`, tensors [B, H, L, D],
when one is attached; the causal Wan processor and AAR's self-attention both do. `inspect_video` and `inspect_aar`
run one rollout of each family with it attached. The observer holds the committed K (pre- and post-RoPE) and V,
about 1.5x the native cache (9 GB beside its 6 GB for a 1.3B rollout of 81 frames in bf16). kv_stats.json is
{"model", "rollout", "statistics", "layers": [{"layer", "tokens", "residual_stream", "heads": [...]}], "summary"};
same inputs give byte-identical JSON (floats kept to 6 significant digits). An AAR rollout's unit is one scale: its
head entries and summary also hold "scales", per scale the tokens, key and value RMS, and the mass on the first scale.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

KMEANS_K = 16
KMEANS_ITERS = 10
KMEANS_SEED = 0
TOP_CHANNELS = 3
DIGITS = 6  # significant digits in the JSON: stable across summation orders that differ in the last bits


# ----------------------------------------------------------------------------------------------------------------
# Statistics of one head's tokens (pure functions: the tests plant cases in them)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def channel_rms(x: torch.Tensor, top: int = TOP_CHANNELS) -> dict[str, Any]:
    """Per-channel RMS over the tokens of x [N, D]: max, median, max / median over channels, largest channels."""
    rms = x.float().pow(2).mean(0).sqrt()
    hi, med = rms.max().item(), torch.quantile(rms, 0.5).item()
    return {"rms_max_over_median": _ratio(hi, med), "rms_max": hi, "rms_median": med,
            "top_channels": rms.topk(min(top, rms.numel())).indices.tolist()}


def token_norms(x: torch.Tensor) -> dict[str, Any]:
    """Spread of the per-token L2 norms of x [N, D]: max / median and p99 / median."""
    norms = x.float().norm(dim=-1)
    med = torch.quantile(norms, 0.5).item()
    return {"norm_max_over_median": _ratio(norms.max().item(), med),
            "norm_p99_over_median": _ratio(torch.quantile(norms, 0.99).item(), med), "norm_median": med}


def kmeans_residual(x: torch.Tensor, k: int = KMEANS_K, iters: int = KMEANS_ITERS,
                    seed: int = KMEANS_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """QVG's k-means on each of P problems x [P, N, D]; returns (residual / sum ||x||^2, residual / sum ||x - mean||^2),
    each [P] float64, where residual = sum ||x - C[id(x)]||^2 (the energy a residual quantiser would still code)."""
    from mmkv.codecs.base import private_generator
    from mmkv.codecs.qvg import gather_centroids, kmeans

    p, n, d = x.shape
    xf = x.float()
    idx = torch.randint(0, n, (p, k), generator=private_generator(seed, "inspect-kmeans")).to(x.device)
    init = torch.gather(xf, 1, idx.unsqueeze(-1).expand(p, k, d)).to(torch.bfloat16)
    ids, centres, _ = kmeans(xf, init, iters, tol=0.0)  # tol 0: always run every iteration
    x64 = xf.double()
    residual = (x64 - gather_centroids(centres, ids).double()).pow(2).sum((1, 2))
    total = x64.pow(2).sum((1, 2))
    centred = (x64 - x64.mean(1, keepdim=True)).pow(2).sum((1, 2))
    return residual / total.clamp(min=1e-300), residual / centred.clamp(min=1e-300)


def first_block_mass(q: torch.Tensor, k: torch.Tensor, first: int, scale: float | None = None,
                     max_elements: int = 1 << 26) -> torch.Tensor:
    """Mean over queries of the softmax mass on keys [:first]: q [P, Lq, D], k [P, Lk, D] -> [P] float32.

    Queries go in chunks so the logits never exceed `max_elements` floats (32760 keys of a full Wan rollout)."""
    p, lq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    chunk = max(1, max_elements // max(1, p * k.shape[1]))
    kf = k.float()
    total = torch.zeros(p, dtype=torch.float32, device=q.device)
    for i in range(0, lq, chunk):
        probs = torch.softmax(torch.matmul(q[:, i:i + chunk].float(), kf.transpose(1, 2)) * scale, dim=-1)
        total += probs[..., :first].sum(-1).sum(-1)
    return total / lq


# ----------------------------------------------------------------------------------------------------------------
# The collector


class KVObserver:
    """What every layer's attention commits, for `summarize`.

    Called as `observer(layer, mode, q, k_pre_rope, k_post_rope, v)` (tensors [B, H, L, D]) by attention modules it is
    attached to; keeps only `mode == "commit"` calls, i.e. the units the KV cache stores. K and V are kept as given
    (references, no copy: about 1.5x the native cache); the first-block attention mass of each later unit is reduced
    on the spot from its queries. `scale` is the attention's logit scale (None: 1/sqrt(D), as SDPA).
    """

    def __init__(self, num_layers: int, *, scale: float | None = None):
        self.num_layers = num_layers
        self.scale = scale
        self.k_pre: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.k_post: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.mass: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # [B, H] per later commit
        self.uniform: list[list[float]] = [[] for _ in range(num_layers)]  # first-unit share of the keys seen
        self.residual: list[list[tuple[float, float]]] = [[] for _ in range(num_layers)]  # (max |x|, median |x|)
        self._mode: str | None = None

    def __call__(self, layer: int, mode: str, q: torch.Tensor, k_pre_rope: torch.Tensor, k_post_rope: torch.Tensor,
                 v: torch.Tensor) -> None:
        self._mode = mode
        if mode != "commit":
            return
        past = self.k_post[layer]
        if past:
            # The commit pass attends [every earlier committed unit | itself]: global attention, native cache.
            keys = torch.cat([*past, k_post_rope], dim=2)
            first = past[0].shape[2]
            b, h = q.shape[:2]
            mass = first_block_mass(q.flatten(0, 1), keys.flatten(0, 1), first, self.scale)
            self.mass[layer].append(mass.view(b, h).cpu())
            self.uniform[layer].append(first / keys.shape[2])
        self.k_pre[layer].append(k_pre_rope.detach())
        self.k_post[layer].append(k_post_rope.detach())
        self.v[layer].append(v.detach())

    def _block_hook(self, layer: int):
        def hook(module, inputs, output):
            if self._mode != "commit":  # the mode of this block's own attention call, which ran just before
                return
            x = (output[0] if isinstance(output, tuple) else output).detach().abs().float()
            # torch.median (lower median) rather than quantile, which stops at 2^24 elements
            self.residual[layer].append((x.max().item(), x.flatten().median().item()))

        return hook

    @contextlib.contextmanager
    def attach(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module] = ()) -> Iterator["KVObserver"]:
        """Set `mmkv_observer` on every module of `model` with an int `mmkv_layer`, and a forward hook on each of
        `blocks` (residual stream after block i); both removed on exit, even on error."""
        targets = [m for m in model.modules() if isinstance(getattr(m, "mmkv_layer", None), int)]
        if not targets:
            raise ValueError(f"KVObserver.attach: no module of {type(model).__name__} has an int `mmkv_layer`; "
                             "install the mmkv attention processors first")
        bad = [m.mmkv_layer for m in targets if not 0 <= m.mmkv_layer < self.num_layers]
        if bad:
            raise ValueError(f"KVObserver.attach: layers {bad} are outside the observer's 0..{self.num_layers - 1}")
        handles = []
        try:
            for m in targets:
                m.mmkv_observer = self
            handles = [block.register_forward_hook(self._block_hook(i)) for i, block in enumerate(blocks)]
            yield self
        finally:
            for h in handles:
                h.remove()
            for m in targets:
                m.__dict__.pop("mmkv_observer", None)
            self._mode = None

    def committed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K pre-RoPE, K post-RoPE, V) of every committed unit of `layer`, [B, H, N, D]."""
        if not self.k_post[layer]:
            raise ValueError(f"layer {layer}: nothing was committed; was the observer attached during the rollout?")
        return tuple(torch.cat(chunks, dim=2) for chunks in (self.k_pre[layer], self.k_post[layer], self.v[layer]))


# ----------------------------------------------------------------------------------------------------------------
# Summaries


def _num(x: Any) -> Any:
    """JSON-ready: floats to DIGITS significant digits, non-finite to None, containers recursively."""
    if isinstance(x, dict):
        return {k: _num(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_num(v) for v in x]
    if isinstance(x, float):
        return float(f"{x:.{DIGITS}g}") if math.isfinite(x) else None
    return x


def _heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] -> [H, B * N, D]: every batch row's tokens pooled per head."""
    return x.transpose(0, 1).flatten(1, 2)


def summarize(obs: KVObserver, *, k: int = KMEANS_K, iters: int = KMEANS_ITERS,
              seed: int = KMEANS_SEED) -> dict[str, Any]:
    """{"layers": [{"layer", "tokens", "residual_stream", "heads": [...]}], "summary": {...}} of what `obs` saw."""
    layers = []
    for layer in range(obs.num_layers):
        k_pre, k_post, v = (_heads(t) for t in obs.committed(layer))
        res = {name: kmeans_residual(t, k, iters, seed) for name, t in (("key_pre_rope", k_pre), ("key", k_post),
                                                                        ("value", v))}
        mass = torch.stack(obs.mass[layer]).mean((0, 1)) if obs.mass[layer] else None  # over commits and batch
        uniform = sum(obs.uniform[layer]) / len(obs.uniform[layer]) if obs.uniform[layer] else None
        heads = []
        for h in range(k_post.shape[0]):
            entry: dict[str, Any] = {"head": h, "key_pre_rope": channel_rms(k_pre[h]), "key": channel_rms(k_post[h]),
                                     "value": token_norms(v[h])}
            for name, (of_total, of_centred) in res.items():
                entry[name]["kmeans_residual"] = of_total[h].item()
                entry[name]["kmeans_residual_centered"] = of_centred[h].item()
            m = None if mass is None else mass[h].item()
            entry["first_block_attention"] = {"mass": m, "uniform_share": uniform,
                                              "mass_over_uniform": None if m is None else _ratio(m, uniform)}
            heads.append(entry)
        residual = None
        if obs.residual[layer]:
            hi = max(r[0] for r in obs.residual[layer])
            med = sorted(r[1] for r in obs.residual[layer])[(len(obs.residual[layer]) - 1) // 2]
            residual = {"max_abs": hi, "median_abs": med, "max_over_median": _ratio(hi, med)}
        layers.append({"layer": layer, "tokens": k_post.shape[1], "residual_stream": residual, "heads": heads})
    return _num({"layers": layers, "summary": _overall(layers)})


# (path in a head entry, label): the per-head statistics of the summary and the plot
HEAD_STATS: tuple[tuple[tuple[str, str], str], ...] = (
    (("key_pre_rope", "rms_max_over_median"), "key channel RMS max/median, pre-RoPE"),
    (("key", "rms_max_over_median"), "key channel RMS max/median, post-RoPE (cached)"),
    (("value", "norm_max_over_median"), "value token norm max/median"),
    (("value", "norm_p99_over_median"), "value token norm p99/median"),
    (("first_block_attention", "mass"), "attention mass on the first block"),
    (("key", "kmeans_residual"), "key k-means residual / energy"),
    (("value", "kmeans_residual"), "value k-means residual / energy"),
)


def _overall(layers: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (group, key), _ in HEAD_STATS:
        cells = [(hd[group][key], lay["layer"], hd["head"]) for lay in layers for hd in lay["heads"]
                 if hd[group][key] is not None]
        if not cells:
            out[f"{group}.{key}"] = None
            continue
        top = max(cells, key=lambda c: c[0])
        out[f"{group}.{key}"] = {"mean": sum(c[0] for c in cells) / len(cells), "max": top[0],
                                 "max_at": {"layer": top[1], "head": top[2]}}
    uniform = [lay["heads"][0]["first_block_attention"]["uniform_share"] for lay in layers]
    out["first_block_attention.uniform_share"] = uniform[0] if uniform and uniform[0] is not None else None
    res = [(lay["residual_stream"]["max_over_median"], lay["layer"]) for lay in layers
           if lay["residual_stream"] and lay["residual_stream"]["max_over_median"] is not None]
    out["residual_stream.max_over_median"] = (
        {"max": max(res)[0], "max_at": {"layer": max(res)[1]}} if res else None)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Rollouts of each family with the observer attached


@torch.no_grad()
def inspect_video(pipe, context: torch.Tensor, noise, grid, **stats: Any):
    """One rollout of a `WanVideoPipeline` over an uncompressed, global-attention cache, observed:
    (`summarize`'s dict, the `RolloutResult`)."""
    dit = pipe.dit
    store = pipe.make_store(None, residual_window=1)
    obs = KVObserver(dit.num_layers)
    with obs.attach(dit.transformer, blocks=dit.transformer.blocks):
        result = pipe.generate(context, noise, store, grid)
    return summarize(obs, **stats), result


def unit_stats(obs: KVObserver) -> list[list[list[dict[str, Any]]]]:
    """Per layer, head and committed unit (AAR: scale): its tokens, its keys' and values' RMS over tokens and channels,
    and the softmax mass its queries put on the first unit's keys beside the uniform share (None for the first unit)."""
    out = []
    for layer in range(obs.num_layers):
        units = obs.k_post[layer]
        if not units:
            raise ValueError(f"layer {layer}: nothing was committed; was the observer attached during the rollout?")
        rms = [k.float().pow(2).mean((0, 2, 3)).sqrt() for k in units]  # [H] per unit, batch rows pooled
        v_rms = [v.float().pow(2).mean((0, 2, 3)).sqrt() for v in obs.v[layer]]
        mass = [None] + [m.mean(0) for m in obs.mass[layer]]  # [H] per later unit, averaged over the batch
        uniform = [None, *obs.uniform[layer]]
        out.append([[{"unit": i, "tokens": units[i].shape[2], "key_rms": rms[i][h].item(),
                      "value_rms": v_rms[i][h].item(),
                      "first_unit_attention": None if mass[i] is None else mass[i][h].item(),
                      "uniform_share": uniform[i]} for i in range(len(units))] for h in range(units[0].shape[1])])
    return out


def _scale_summary(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scale, over every layer and head: mean and max key and value RMS, mean first-scale attention mass."""
    cells = [hd["scales"] for lay in layers for hd in lay["heads"]]
    out = []
    for i, first in enumerate(cells[0]):
        rms = [c[i]["key_rms"] for c in cells]
        v_rms = [c[i]["value_rms"] for c in cells]
        mass = [c[i]["first_scale_attention"] for c in cells if c[i]["first_scale_attention"] is not None]
        out.append({"scale": i, "tokens": first["tokens"], "key_rms_mean": sum(rms) / len(rms), "key_rms_max": max(rms),
                    "value_rms_mean": sum(v_rms) / len(v_rms), "value_rms_max": max(v_rms),
                    "first_scale_attention_mean": sum(mass) / len(mass) if mass else None,
                    "uniform_share": first["uniform_share"]})
    return out


@torch.no_grad()
def inspect_aar(aar, sat, cond: torch.Tensor, *, seed: int, key: str, k: int = KMEANS_K, iters: int = KMEANS_ITERS,
                kmeans_seed: int = KMEANS_SEED):
    """One AAR rollout (`mmkv.pipelines.aar.sample.rollout`, native store, default sampling; one unit = one scale, the
    first block = the first scale) observed: (`summarize`'s dict with a "scales" list in every head entry and in the
    summary, the `Rollout`). AAR has no RoPE, so its pre- and post-RoPE keys are the same."""
    from mmkv.cache import CacheConfig, KVStore
    from mmkv.pipelines.aar.sample import rollout

    cfg = aar.config
    store = KVStore(CacheConfig(codec=None, residual_window=1), num_layers=cfg.depth, num_heads=cfg.num_heads,
                    head_dim=cfg.head_dim)
    obs = KVObserver(cfg.depth, scale=aar.blocks[0].attn.scale)  # q already carries cos-attention's per-head gain
    with obs.attach(aar, blocks=aar.blocks):
        result = rollout(aar, sat, cond, seed=seed, key=key, store=store)
    summary = summarize(obs, k=k, iters=iters, seed=kmeans_seed)
    for lay, heads in zip(summary["layers"], _num(unit_stats(obs))):
        for hd, units in zip(lay["heads"], heads):
            hd["scales"] = [{"scale": u["unit"], "tokens": u["tokens"], "key_rms": u["key_rms"],
                             "value_rms": u["value_rms"], "first_scale_attention": u["first_unit_attention"],
                             "uniform_share": u["uniform_share"]}
                            for u in units]
    summary["summary"]["scales"] = _num(_scale_summary(summary["layers"]))
    return summary, result


# ----------------------------------------------------------------------------------------------------------------
# Plot


def plot(stats: dict[str, Any], path: Path, title: str = "", unit: str = "block") -> Path:
    """A grid of panels, one a statistic: x = layer, one line per head (residual stream: one line); where the heads
    carry "scales" (AAR), a third row with x = scale, one line per layer and head: key and value RMS, first-scale
    mass."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from mmkv.io import atomic_path

    layers = stats["layers"]
    xs = [lay["layer"] for lay in layers]
    num_heads = len(layers[0]["heads"]) if layers else 0
    scales = bool(num_heads) and "scales" in layers[0]["heads"][0]
    fig = Figure(figsize=(16, 10.5 if scales else 7))
    FigureCanvasAgg(fig)
    axes = fig.subplots(3 if scales else 2, 4).flatten()
    for ax, ((group, key), label) in zip(axes, HEAD_STATS):
        for h in range(num_heads):
            ys = [lay["heads"][h][group][key] for lay in layers]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", lw=1.2, ms=3, label=f"head {h}")
        if group == "first_block_attention":
            share = [lay["heads"][0][group]["uniform_share"] if num_heads else None for lay in layers]
            (line,) = ax.plot(xs, [math.nan if s is None else s for s in share], "k--", lw=1)
            ax.legend([line], ["uniform share"], fontsize=7)
        ax.set_title(label.replace("first block", f"first {unit}"), fontsize=9)
    ax = axes[len(HEAD_STATS)]
    ys = [lay["residual_stream"]["max_over_median"] if lay["residual_stream"] else None for lay in layers]
    ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", color="k", lw=1.2, ms=3)
    ax.set_title("residual stream max|x| / median|x| (commit)", fontsize=9)
    for ax in axes[:8]:
        ax.set_xlabel("layer", fontsize=8)
    if scales:
        _plot_scales(axes[8:], layers)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if num_heads:
        axes[0].legend(fontsize=7, ncol=2 if num_heads > 6 else 1)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.05 if scales else 0.07, top=0.93 if scales else 0.91,
                        wspace=0.22, hspace=0.32)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path


def _plot_scales(axes, layers: list[dict[str, Any]]) -> None:
    """The per-scale row: key RMS, value RMS and first-scale attention mass against the scale, one line per
    (layer, head)."""
    for ax, key, label in ((axes[0], "key_rms", "key RMS per scale (cached, post-normalisation)"),
                           (axes[1], "value_rms", "value RMS per scale"),
                           (axes[2], "first_scale_attention", "attention mass on the first scale, per scale")):
        for lay in layers:
            for hd in lay["heads"]:
                xs = [u["scale"] for u in hd["scales"]]
                ys = [math.nan if u[key] is None else u[key] for u in hd["scales"]]
                ax.plot(xs, ys, marker="o", lw=1, ms=2, label=f"L{lay['layer']} h{hd['head']}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("scale", fontsize=8)
    units = layers[0]["heads"][0]["scales"]
    (line,) = axes[2].plot([u["scale"] for u in units],
                           [math.nan if u["uniform_share"] is None else u["uniform_share"] for u in units], "k--", lw=1)
    axes[2].legend([line], ["uniform share"], fontsize=7)
    if sum(len(lay["heads"]) for lay in layers) <= 16:
        axes[0].legend(fontsize=6, ncol=2)
    for ax in axes[3:]:
        ax.set_visible(False)

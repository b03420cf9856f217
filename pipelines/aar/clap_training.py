"""The CLAP pieces of `mmkv train audio`: the tiny model, its embeddings, the contrastive loss with same-caption
positives, and held-out text-to-audio retrieval."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from mmkv.pipelines.aar import clap, sounds
from mmkv.pipelines.training import (
    seeded,
)
from mmkv.pipelines.aar.train_data import ATTRIBUTES, clap_inputs, render_clips, tokenize

if TYPE_CHECKING:
    from mmkv.pipelines.aar.train import AudioTrainConfig


def build_clap(cfg: AudioTrainConfig, vocab_size: int, seed: int):
    from transformers import ClapConfig, ClapModel

    # No dropout: it would draw from the global RNG; the data are endless and the captions short.
    text = {**cfg.clap_text, "vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
            "max_position_embeddings": max(cfg.clap_text.get("max_position_embeddings", 0), cfg.text_len + 2),
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    audio = {**cfg.clap_audio, "hidden_dropout_prob": 0.0}
    config = ClapConfig(text_config=text, audio_config=audio, projection_dim=clap.EMBED_DIM)
    return seeded(seed, lambda: ClapModel(config))


def audio_embeddings(model, features: torch.Tensor) -> torch.Tensor:
    """L2-normalised audio_projection(audio_model(...).pooler_output): `ClapEmbedder.embed_wave`'s embedding."""
    is_longer = torch.zeros(features.shape[0], 1, dtype=torch.bool, device=features.device)
    out = model.audio_model(input_features=features, is_longer=is_longer)
    return F.normalize(model.audio_projection(out.pooler_output), dim=-1)


def text_embeddings(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model.text_model(input_ids=ids, attention_mask=mask)
    return F.normalize(model.text_projection(out.pooler_output), dim=-1)


def contrastive_loss(model, audio: torch.Tensor, text: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE with CLAP's two learned temperatures; the targets of a row are uniform over the clips whose
    captions name the same attributes (a batch holds repeated captions)."""
    same = (groups[:, None] == groups[None, :]).float()
    target = same / same.sum(1, keepdim=True)
    per_text = text @ audio.T * model.logit_scale_t.exp()
    per_audio = audio @ text.T * model.logit_scale_a.exp()
    return 0.5 * (F.cross_entropy(per_text, target) + F.cross_entropy(per_audio, target))


@torch.no_grad()
def retrieval(model, tokenizer, extractor, cfg: AudioTrainConfig, device: torch.device) -> dict[str, Any]:
    """Text-to-audio retrieval over held-out clips: for each clip's caption, is the top-1 clip's attribute the
    named one? Per attribute, against chance (the share of clips with that value)."""
    held = [sounds.sample_sound(s) for s in sounds.held_out_seeds(cfg.retrieval_clips)]
    wave = render_clips(held, cfg, device, torch.Generator().manual_seed(1))
    feats = clap_inputs(wave, cfg, extractor, device)
    audio = torch.cat([audio_embeddings(model, feats[i:i + cfg.encode_batch])
                       for i in range(0, len(held), cfg.encode_batch)])
    ids, mask = tokenize(tokenizer, [sounds.caption(s) for s in held], cfg.text_len)
    text = text_embeddings(model, ids.to(device), mask.to(device))
    top = (text @ audio.T).argmax(dim=1).tolist()
    named = [s.named for s in held]
    scores = {}
    for attr in ATTRIBUTES:
        queries = [i for i, n in enumerate(named) if attr in n]
        if not queries:
            continue
        hit = [named[top[i]].get(attr) == named[i][attr] for i in queries]
        chance = [np.mean([m.get(attr) == named[i][attr] for m in named]) for i in queries]
        scores[attr] = {"accuracy": round(float(np.mean(hit)), 4), "chance": round(float(np.mean(chance)), 4),
                        "queries": len(queries)}
    exact = [named[top[i]] == named[i] for i in range(len(held))]
    chance = [np.mean([m == n for m in named]) for n in named]
    scores["all_named"] = {"accuracy": round(float(np.mean(exact)), 4), "chance": round(float(np.mean(chance)), 4),
                           "queries": len(held)}
    return {"clips": len(held), "text_to_audio_top1": scores}


def _summary(scores: dict[str, Any]) -> str:
    top = scores["text_to_audio_top1"]
    return ", ".join(f"{a} {v['accuracy']:.2f} (chance {v['chance']:.2f})" for a, v in top.items())

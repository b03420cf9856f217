"""Video and audio quality metrics of a compressed-cache rollout against its bf16-cache reference
(installed as `mmkv.metrics`; imports nothing from the pipelines).

Video (uint8 frames [F, H, W, 3] from the lossless dump, never the mp4)::

    video_metrics(ref_frames, test_frames, ref_latents=None, test_latents=None, lpips_net=None, *,
                  fps=16, window_edges_s=None, device=None) -> dict
        {"per_frame": {"mse", "psnr", "ssim"[, "lpips"]: [F floats]},
         "summary": {"psnr" (PSNR of the pooled MSE), "psnr_frame_mean", "mse", "ssim", "lpips",
                     "latent_cosine", "identical_frames", "n_frames"},
         "windows": [{"label", "start_s", "end_s", "first_frame", "end_frame", "n_frames", <means>}, ...],
         "kind": "video", "fps", "n_frames", "config"}
    load_lpips(weights=None, *, random_trunk=False, seed=0, device=None) -> LPIPS module (.trunk_id)
    psnr_frames / ssim_frames / mse_frames(ref, test, *, device=None) -> np.ndarray [F]
    lpips_frames(net, ref, test) -> np.ndarray [F]
    window_bounds(n_frames, fps=16, edges_s=None), windowed_means(per_frame, fps=16, edges_s=None)

Audio (float PCM, [N] or [N, C])::

    audio_metrics(ref_wav, test_wav, sample_rate, ref_latent=None, test_latent=None,
                  ref_tokens=None, test_tokens=None) -> dict
        {"summary": {"lsd_db", "log_mel_mse", "snr_db", "snr_at_cap", "latent_cosine", "token_agreement",
                     "n_samples"}, "kind": "audio", "sample_rate", "config"}
    lsd_db(ref, test), log_mel_mse(ref, test, sample_rate), snr_db(ref, test, cap=120.0), log_mel(x, sample_rate)

Shared: latent_cosine(ref, test) -> float. The conventions behind each number are in the module docstrings of
`mmkv.metrics.video` and `mmkv.metrics.audio`.
"""

from mmkv.metrics.audio import (
    AUDIO_METRIC_CONFIG,
    SNR_CAP_DB,
    audio_metrics,
    log_mel,
    log_mel_mse,
    lsd_db,
    mel_filterbank,
    snr_db,
    token_agreement,
)
from mmkv.metrics.latent import latent_cosine
from mmkv.metrics.video import (
    ALEXNET_FILE,
    DEFAULT_FPS,
    DEFAULT_WINDOW_EDGES_S,
    VIDEO_METRIC_CONFIG,
    LPIPSWeightsNotFound,
    aggregate_frames,
    default_alexnet_path,
    load_lpips,
    lpips_frames,
    mse_frames,
    psnr_frames,
    psnr_from_mse,
    ssim_frames,
    video_metrics,
    window_bounds,
    windowed_means,
)

__all__ = [
    "ALEXNET_FILE", "AUDIO_METRIC_CONFIG", "DEFAULT_FPS", "DEFAULT_WINDOW_EDGES_S", "LPIPSWeightsNotFound",
    "SNR_CAP_DB", "VIDEO_METRIC_CONFIG", "aggregate_frames", "audio_metrics", "default_alexnet_path",
    "latent_cosine", "load_lpips", "log_mel", "log_mel_mse", "lpips_frames", "lsd_db", "mel_filterbank",
    "mse_frames", "psnr_frames", "psnr_from_mse", "snr_db", "ssim_frames", "token_agreement", "video_metrics",
    "window_bounds", "windowed_means",
]

"""Video and audio quality metrics (installed as `mmkv.metrics`)."""

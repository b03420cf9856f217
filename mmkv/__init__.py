"""mmkv: compressed attention KV caches for autoregressive video and audio generators."""

__version__ = "0.1.0"

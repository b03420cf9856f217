"""mmkv: compressed attention KV caches for autoregressive video and audio generators."""

__version__ = "0.1.0"

# The kernel registry: it installs itself as the codecs' kernel lookup; the kernels load on first CUDA use.
import mmkv.kernels.dispatch  # noqa: E402,F401

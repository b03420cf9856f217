"""KV-cache codecs: a registry by name (`mmkv.codecs.registry`), typed configs (`mmkv.codecs.config`), and one file
per codec, each a torch reference."""

from mmkv.codecs.base import Codec  # noqa: F401
from mmkv.codecs.config import CodecConfig, CodecError  # noqa: F401
from mmkv.codecs.encoded import Encoded  # noqa: F401
from mmkv.codecs.registry import (  # noqa: F401
    build, display_name, get_codec_class, kv_configs, names, register, registered,
)
from mmkv.codecs.seeds import derive_seed, private_generator  # noqa: F401

"""KV-cache codecs: a registry by name, typed configs, and one file per codec (each a torch reference)."""

from mmkv.codecs.base import (  # noqa: F401
    Codec,
    CodecConfig,
    CodecError,
    Encoded,
    build,
    derive_seed,
    get_codec_class,
    names,
    private_generator,
    register,
)

# Importing a codec module registers it (and its codebook families). Keep this list alphabetical.
from mmkv.codecs import identity  # noqa: F401,E402
import importlib as _importlib

for _mod in (
    "groupquant", "kivi", "octopus", "octopus_qjl", "oscar", "polarquant", "qjl", "qvg", "turboquant_mse",
    "turboquant_prod",
):
    try:
        _importlib.import_module(f"mmkv.codecs.{_mod}")
    except ModuleNotFoundError as _err:  # a codec still being written; remove this guard once all exist
        if _err.name != f"mmkv.codecs.{_mod}":
            raise

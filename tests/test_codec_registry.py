"""The codec registry and typed configs: a codec added in one file plus one registry line gets the common codec
checks (tests/test_codecs_common.py) without editing them, and preset strings round-trip unchanged."""

from __future__ import annotations

import pytest
import torch

import test_codecs_common as common
from mmkv.codecs import CodecConfig, CodecError, build, display_name, get_codec_class, names, registered
from mmkv.codecs.registry import BUILTIN
from toy_codec import ToyCodec

TOY = "toy-absmax"

PRESET_CHECKS = [
    common.test_nbytes_is_the_real_packed_size, common.test_same_seed_gives_identical_bytes,
    common.test_another_seed_gives_another_rotation, common.test_decode_into_out,
    common.test_token_local_codecs_concatenate_exactly, common.test_single_head_rank2_input,
    common.test_nan_and_inf_are_refused, common.test_wrong_rank_dtype_and_shape_are_refused,
    common.test_decoding_another_codecs_bytes_is_refused, common.test_zero_vectors_decode_to_zeros,
    common.test_round_trip_property,
]
NAME_CHECKS = [common.test_head_dim_not_a_power_of_two, common.test_unsupported_bits_are_refused]


@pytest.mark.parametrize("check", PRESET_CHECKS + NAME_CHECKS, ids=lambda f: f.__name__)
def test_a_codec_added_in_one_file_passes_the_common_checks(check):
    with registered(ToyCodec):
        assert TOY in names() and display_name(TOY) == "Toy"
        check(TOY)
    assert TOY not in names()  # registered() undoes itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_codec_added_in_one_file_round_trips(dtype):
    with registered(ToyCodec):
        common.test_round_trip_keeps_shape_dtype_device(TOY, dtype, "cpu")


def test_every_builtin_is_registered_under_its_config_name():
    for name in BUILTIN:
        cls = get_codec_class(name)
        assert cls.name == cls.config_class.name == name and cls.display_name


def test_old_width_spellings_parse_to_bits_and_print_as_before():
    """Every codec's width is its `bits` field; `b=` and `bits=` both parse, and the canonical string keeps the key
    each codec has always printed (it names run folders and bench rows)."""
    for preset, printed in [("octopus:bits=2", "octopus:b=2,dir=auto,joint=1,norm=32,rho=auto"),
                            ("octopus:b=2", "octopus:b=2,dir=auto,joint=1,norm=32,rho=auto"),
                            ("kivi:b=4,g=16", "kivi:bits=4,group=16,meta=fp16,role=k"),
                            ("turboquant-mse:bits=3", "turboquant-mse:b=3,hi=0,norm=32"),
                            ("qvg:b=4,asym=1", "qvg:asymmetric=1,bits=4,block=64,centroids=256,iters=2,span_units=0,"
                                               "stages=1,tol=0.0001")]:
        cfg = CodecConfig.parse(preset)
        assert str(cfg) == printed and CodecConfig.parse(printed) == cfg and cfg.bits == cfg.nominal_bits


def test_bad_config_values_name_what_is_allowed():
    with pytest.raises(CodecError, match=r"unsupported bits=9; supported: \[1, 2, 3, 4, 5\]"):
        CodecConfig.parse("octopus:b=9")
    with pytest.raises(CodecError, match="meta must be one of"):
        CodecConfig.parse("kivi:meta=fp8")
    with pytest.raises(CodecError, match="no parameter 'nope'.*allowed"):
        CodecConfig.parse("qjl:nope=1")
    with pytest.raises(CodecError, match="unknown codec 'nosuch'"):
        build("nosuch", head_dim=64)


def test_kernels_import_codecs_and_never_the_reverse():
    """The kernel registry installs itself as the codecs' kernel lookup when `mmkv` is imported; no codec module
    names the kernels."""
    from pathlib import Path

    import mmkv.codecs.base as base
    from mmkv.kernels import dispatch

    assert base._KERNEL_LOOKUP is dispatch.lookup
    codecs_dir = Path(base.__file__).parent
    offenders = [p.name for p in codecs_dir.glob("*.py") if "mmkv.kernels" in p.read_text(encoding="utf-8")]
    assert not offenders

"""`mmkv bench audio`: its full-size rollouts need a GPU; `--tiny` runs the same bench on the micro AAR on the CPU."""

import json

import pytest

from mmkv.bench import audio
from mmkv.cli import main


def test_tiny_bench_has_a_row_per_codec_and_identity_is_bit_exact(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["bench", "audio", "--tiny", "--repeats", "1", "--codecs", "identity;kivi:bits=2,group=32", "--json",
            str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["codec"] for r in rows] == ["native cache", "identity", "kivi:bits=2,group=32"]
    native, identity, kivi = rows
    assert native["ratio_to_native"] == 1.0 and native["kv_ratio"] == 1.0 and native["dtype"] == "bf16"
    assert identity["bit_exact"] and identity["token_agreement"] == 1.0 and identity["kv_bytes"] == native["kv_bytes"]
    assert not kivi["bit_exact"] and kivi["kv_ratio"] > 1 and kivi["kv_bytes"] < native["kv_bytes"]
    assert kivi["bf16_kv_over_kvx"] == pytest.approx(native["peak_kv_bytes"] / kivi["kv_ratio"], rel=1e-3)
    text = capsys.readouterr().out
    assert "| kivi:bits=2,group=32 |" in text and "x native cache" in text and "peak CUDA MiB" in text


def test_paired_times_a_native_rollout_before_each_codec_rollout(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["bench", "audio", "--tiny", "--repeats", "2", "--codecs", "identity", "--paired", "--json",
                 str(out)]) == 0
    native, identity = json.loads(out.read_text())
    assert native["paired_native_seconds"] is None
    assert len(identity["paired_native_seconds"]) == len(identity["all_seconds"]) == 2
    assert identity["bit_exact"]


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")  # torch's note on a second profile in a process
def test_tiny_bench_profiles_a_rollout_per_codec(tmp_path):
    """`--profile`: one more rollout per codec under torch.profiler, its summary in the row (on the CPU: no kernel
    launches or GPU time, but the host's costliest ops)."""
    out = tmp_path / "rows.json"
    assert main(["bench", "audio", "--tiny", "--repeats", "1", "--codecs", "kivi:bits=2,group=32", "--profile",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["codec"] for r in rows] == ["native cache", "kivi:bits=2,group=32"]
    for row in rows:
        prof = row["profile"]
        assert prof["wall_s"] > 0 and prof["host_top_ms"] and all(v >= 0 for v in prof["host_top_ms"].values())
        assert {"gpu_kernel_s", "launches", "host_syncs", "cuda_mallocs"} <= set(prof)
        # the host's Python by function (one more rollout under cProfile): the rollout's own loop is in it
        assert prof["python_s"] > 0 and prof["c_functions_s"] > 0 and len(prof["python_top_ms"]) == 12
        assert list(prof["python_top_ms"]) == list(prof["python_top_calls"])
        assert all(v >= 0 for v in prof["python_top_ms"].values())
        assert list(prof["python_top_ms"].values()) == sorted(prof["python_top_ms"].values(), reverse=True)
    kivi = rows[1]["profile"]["python_top_ms"]
    assert any(k.startswith(("codecs/", "cache/")) for k in kivi), kivi  # the codec's and store's Python shows


def test_refuses_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(["bench", "audio"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_default_codecs_are_the_demos():
    from mmkv.demo import CODECS, QVG

    assert audio._codecs(audio.DEFAULT_CODECS) == [*CODECS[1:], *QVG]


def test_blocks_run_in_bf16_and_hand_fp32_on():
    import torch

    from mmkv.pipelines.aar.tiny import build_tiny

    aar, _ = build_tiny("micro")
    audio.blocks_in(aar, torch.bfloat16)
    assert {p.dtype for p in aar.blocks.parameters()} == {torch.bfloat16}
    assert aar.head.weight.dtype == torch.float32
    x = torch.randn(2, 3, aar.config.embed_dim)
    cond = torch.randn(2, aar.config.embed_dim)
    assert aar.blocks[0](x=x, cond_BD=cond, attn_bias=None).dtype == torch.float32

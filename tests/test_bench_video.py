"""`mmkv bench video` needs a GPU for its rollouts; its CPU-side parts are checked here."""

import pytest

from mmkv.bench import video
from mmkv.cli import main


def test_table_has_a_row_per_codec_with_its_ratio():
    rows = [
        {"codec": "bf16 cache", "frames": 21, "seconds": 3.0, "ratio_to_bf16": 1.0, "kv_bytes": 6 << 30, "kv_ratio": 1.0,
         "peak_kv_bytes": 6 << 30, "bf16_kv_over_kvx": 6 << 30, "peak_cuda_bytes": 9 << 30, "rel_latent_diff": 0.0},
        {"codec": "octopus:b=2", "frames": 21, "seconds": 3.3, "ratio_to_bf16": 1.1, "kv_bytes": 1 << 30, "kv_ratio": 4.67,
         "peak_kv_bytes": 5 << 29, "bf16_kv_over_kvx": 1315 << 20, "peak_cuda_bytes": 4 << 30, "rel_latent_diff": 0.41},
    ]
    text = video.table(rows, "H200")
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(lines) == 3 and "x bf16 cache" in lines[0]
    assert "| octopus:b=2 | 21 | 3.30 | 1.10 | 1024 | 4.67 | 2560 | 1315 | 4.00 | nan | 0.410 |" in text


def test_codec_list_is_split_on_semicolons():
    assert video._codecs("octopus:b=2;oscar:bits=2,group=32; ;turboquant-mse:b=2") == [
        "octopus:b=2", "oscar:bits=2,group=32", "turboquant-mse:b=2"]


def test_frame_list_is_parsed_and_checked():
    assert video._frames("21") == [21] and video._frames("21,42") == [21, 42]
    for bad in ("", "0", "a,3", "21,-3"):
        with pytest.raises(ValueError, match="--frames"):
            video._frames(bad)


def test_refuses_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(["bench", "video", "--frames", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "video", "--tiny", "--cuda-graphs"]) == 2
    assert "--cuda-graphs needs a CUDA GPU; run without --cuda-graphs on the CPU" in capsys.readouterr().err


def test_profile_summary_counts_kernels_launches_and_syncs():
    from types import SimpleNamespace as E

    cuda, cpu = "DeviceType.CUDA", "DeviceType.CPU"
    events = [
        E(key="sdpa_kernel", count=10, device_type=cuda, self_device_time_total=2_000_000.0),
        E(key="_octopus_decode_kernel", count=40, device_type=cuda, self_device_time_total=500_000.0),
        E(key="cudaLaunchKernel", count=30, device_type=cpu, self_device_time_total=0.0),
        E(key="cuLaunchKernelEx", count=40, device_type=cpu, self_device_time_total=0.0),
        E(key="cudaStreamSynchronize", count=7, device_type=cpu, self_device_time_total=0.0),
        E(key="cudaMalloc", count=3, device_type=cpu, self_device_time_total=0.0),
        E(key="cudaFree", count=2, device_type=cpu, self_device_time_total=0.0),
    ]
    for e, cpu_us in zip(events, (10.0, 20.0, 3000.0, 5000.0, 900.0, 40.0, 7000.0)):
        e.self_cpu_time_total = cpu_us
    s = video.profile_summary(events)
    assert s["gpu_kernel_s"] == 2.5 and s["launches"] == 70 and s["triton_launches"] == 40 and s["host_syncs"] == 7
    assert list(s["top_kernels_ms"]) == ["sdpa_kernel", "_octopus_decode_kernel"]
    assert s["most_launched"] == {"_octopus_decode_kernel": 40, "sdpa_kernel": 10}
    assert s["kernels"] == {"sdpa_kernel": [2000.0, 10], "_octopus_decode_kernel": [500.0, 40]}  # ms, launches
    assert s["cuda_mallocs"] == 3 and s["cuda_frees"] == 2
    # host time: CPU-side events only, most first, in ms
    assert s["host_top_ms"] == {"cudaFree": 7.0, "cuLaunchKernelEx": 5.0, "cudaLaunchKernel": 3.0,
                                "cudaStreamSynchronize": 0.9, "cudaMalloc": 0.0}


def test_tiny_bench_runs_every_loop_and_codec_in_one_process(tmp_path, capsys):
    """`--tiny`: the tiny DiT on the CPU through the same bench: one row per (loop, codec), each loop's bf16-cache
    baseline first, identity bit-exact with the native cache and a real codec not, KV x measured."""
    import json

    out = tmp_path / "rows.json"
    argv = ["bench", "video", "--tiny", "--frames", "6", "--repeats", "1", "--codecs",
            "identity;kivi:bits=2,group=32;turboquant-mse:b=4", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["codec"]) for r in rows] == [
        (m, c) for m in ("causvid", "causal-forcing-frame")
        for c in ("bf16 cache", "identity", "kivi:bits=2,group=32", "turboquant-mse:b=4")]
    by = {(r["model"], r["codec"]): r for r in rows}
    for m in ("causvid", "causal-forcing-frame"):
        assert by[m, "identity"]["bit_exact"] and by[m, "identity"]["rel_latent_diff"] == 0.0
        assert not by[m, "kivi:bits=2,group=32"]["bit_exact"] and by[m, "kivi:bits=2,group=32"]["kv_ratio"] > 1
        assert by[m, "bf16 cache"]["ratio_to_bf16"] == 1.0 and by[m, "bf16 cache"]["peak_cuda_bytes"] is None
    assert "| causal-forcing-frame | turboquant-mse:b=4 | 6 |" in capsys.readouterr().out


def test_a_bench_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """The JSON is written after every row, so a device call killed at its time limit keeps what it measured (here
    the third row's table entry raises, as a kill would interrupt it)."""
    import json

    made = []
    real = video._row

    def row(*a, **k):
        if len(made) == 2:
            raise KeyboardInterrupt
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(video, "_row", row)
    out = tmp_path / "rows.json"
    argv = ["bench", "video", "--tiny", "--frames", "6", "--repeats", "1", "--model", "causvid", "--codecs",
            "identity;kivi:bits=2,group=32", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert [r["codec"] for r in json.loads(out.read_text())] == ["bf16 cache", "identity"]


def test_default_codecs_are_the_demos_at_two_and_four_bits_and_qvg():
    from mmkv.demo import CODECS

    assert video._codecs(video.DEFAULT_CODECS) == [*CODECS[1:], "qvg:bits=2", "qvg:bits=4"]
    assert video._models(video.DEFAULT_MODELS) == ["causvid", "causal-forcing-frame"]


def test_paired_runs_a_baseline_before_each_codec_rollout_and_reports_the_median_ratio(tmp_path):
    """`--paired`: each timed codec rollout follows a bf16-cache rollout; the row keeps both series and its ratio is
    the median of the pairs' ratios, not the ratio of the medians."""
    import json
    import statistics

    out = tmp_path / "rows.json"
    assert main(["bench", "video", "--tiny", "--frames", "6", "--repeats", "3", "--model", "causvid", "--codecs",
                 "identity", "--paired", "--json", str(out)]) == 0
    base, ident = json.loads(out.read_text())
    assert base["paired_bf16_seconds"] is None and base["ratio_to_bf16"] == 1.0
    pairs = ident["paired_bf16_seconds"]
    assert len(pairs) == len(ident["all_seconds"]) == 3
    want = statistics.median(t / b for t, b in zip(ident["all_seconds"], pairs))
    # the row's seconds are rounded to 1 ms of tiny rollouts (tens of ms): the ratio, from the unrounded ones,
    # agrees to a few per cent (`test_ratio_is_the_median_of_pairs_only_when_paired` checks the arithmetic)
    assert ident["ratio_to_bf16"] == pytest.approx(want, rel=0.1)


def test_ratio_is_the_median_of_pairs_only_when_paired():
    res = {"seconds": 2.0, "all_seconds": [1.0, 2.0, 9.0], "paired_base_seconds": [1.0, 1.0, 3.0]}
    assert video.ratio(res, {"seconds": 1.5}) == 2.0  # pairs 1, 2, 3
    assert video.ratio({**res, "paired_base_seconds": None}, {"seconds": 1.5}) == pytest.approx(4 / 3)


def test_full_warmup_warms_each_codec_up_on_a_full_length_rollout(tmp_path):
    import json

    out = tmp_path / "rows.json"
    argv = ["bench", "video", "--tiny", "--frames", "6", "--repeats", "1", "--model", "causvid", "--codecs", "identity",
            "--json", str(out)]
    assert main(argv) == 0
    assert [r["warmup_frames"] for r in json.loads(out.read_text())] == [6, 6]  # two blocks of 3 frames
    assert main([*argv[:-2], "--frames", "9", "--full-warmup", "--json", str(out)]) == 0
    assert [r["warmup_frames"] for r in json.loads(out.read_text())] == [9, 9]


def test_jobs_warm_every_codec_in_workers_first_and_keep_the_rows(tmp_path, capsys):
    """`--jobs`: one worker process a codec runs its warm-up rollouts on every loop (`--warm-only`, with the bench's
    settings) before the timed process starts; the rows are those of a run without workers."""
    import json

    out = tmp_path / "rows.json"
    argv = ["bench", "video", "--tiny", "--frames", "6", "--repeats", "1", "--model", "causvid", "--codecs",
            "identity;turboquant-mse:b=4", "--jobs", "2", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "[warm] identity: compiled" in printed and "[warm] turboquant-mse:b=4: compiled" in printed
    assert "[warm] 2 codecs in" in printed and "failed: none" in printed
    rows = json.loads(out.read_text())
    assert [r["codec"] for r in rows] == ["bf16 cache", "identity", "turboquant-mse:b=4"]
    assert rows[1]["rel_latent_diff"] == 0.0 and rows[2]["rel_latent_diff"] > 0


def test_a_failing_worker_is_reported_and_the_bench_goes_on():
    import argparse

    args = argparse.Namespace(model="causvid", frames="6", residual_window=1, latent_size=None, window=None, sink=0,
                              tiny=True, full_warmup=False, no_merge=False, reuse_decoded=False, jobs=1,
                              cuda_graphs=False)
    lines = []
    assert video.precompile(args, ["no-such-codec:b=2"], log=lines.append) == ["no-such-codec:b=2"]
    assert "worker failed" in lines[0] and "no-such-codec" in lines[0] and "failed: no-such-codec:b=2" in lines[-1]
    argv = video.worker_argv(args, "kivi:bits=2,group=32")
    assert argv[1:6] == ["-m", "mmkv.cli", "bench", "video", "--warm-only"] and "--tiny" in argv
    assert argv[argv.index("--codecs") + 1] == "kivi:bits=2,group=32" and "--full-warmup" not in argv
    assert "--cuda-graphs" not in argv  # a worker warms what the timed process runs: graphed calls when it graphs
    args.cuda_graphs = True
    assert "--cuda-graphs" in video.worker_argv(args, "kivi:bits=2,group=32")

"""The `mmkv` command line.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`; only the module of the
command being run is imported, so `mmkv bench synthetic` never pays for the video stack.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (command words, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "mmkv.demo", "run the whole harness offline on tiny models (CPU, a few minutes)"),
    (("generate", "video"), "mmkv.pipelines.video_cli", "render bf16-cache and compressed-cache videos from a prompt file"),
    (("compare", "audio"), "mmkv.pipelines.audio_cli", "compare codecs side by side on audio clips (AAR + CLAP)"),
    (("report",), "mmkv.report.cli", "tables, plots and an HTML gallery from one or more run folders"),
    (("bench", "synthetic"), "mmkv.bench.synthetic", "the OCTOPUS section 4.1 synthetic codec benchmark"),
    (("bench", "kernels"), "mmkv.bench.kernels", "GPU kernel benchmark against bf16 SDPA in the same process"),
    (("bench", "video"), "mmkv.bench.video", "GPU: full-size causal Wan DiT rollouts, compressed caches vs the bf16 cache"),
    (("bench", "audio"), "mmkv.bench.audio", "GPU: full-size AAR + SAT rollouts, compressed caches vs the native cache"),
    (("inspect", "kv"), "mmkv.inspect", "KV-cache statistics of one rollout per layer and head (JSON + plot)"),
    (("train", "video"), "mmkv.pipelines.wan.train", "train the tiny video models on procedural clips (CUDA)"),
    (("train", "audio"), "mmkv.pipelines.aar.train", "train the tiny audio models (CLAP, SAT, AAR) on procedural clips"),
    (("train", "all"), "mmkv.pipelines.train_all", "every stage of both, side by side, resumable, then eval and release"),
    (("ship", "video"), "mmkv.pipelines.wan.release", "copy a trained video release into an asset folder (SHA256SUMS)"),
    (("ship", "audio"), "mmkv.pipelines.aar.release", "write the bf16 release folder of trained audio models (SHA256SUMS)"),
    (("eval", "video"), "mmkv.pipelines.wan.evaluate", "prompt adherence of a video model on held-out procedural prompts"),
    (("codebooks", "build"), "mmkv.codecs.codebooks", "regenerate the shipped Lloyd-Max codebooks"),
]


class UsageError(Exception):
    """A command line the user can fix; printed without a traceback."""


def _top_help() -> str:
    lines = ["usage: mmkv COMMAND [...]", "", "commands:"]
    for words, _, text in COMMANDS:
        lines.append(f"  {' '.join(words):<20} {text}")
    lines.append("")
    lines.append("Run `mmkv COMMAND --help` for a command's options.")
    return "\n".join(lines)


def _match(argv: list[str]) -> tuple[tuple[str, ...], str, str] | None:
    for words, module, text in COMMANDS:
        if tuple(argv[: len(words)]) == words:
            return words, module, text
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0
    if argv[0] in ("-V", "--version"):
        from mmkv import __version__

        print(__version__)
        return 0
    found = _match(argv)
    if found is None:
        print(f"mmkv: unknown command {' '.join(argv[:2])!r}\n\n{_top_help()}", file=sys.stderr)
        return 2
    words, module_name, text = found
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog="mmkv " + " ".join(words), description=text)
    module.add_arguments(parser)
    args = parser.parse_args(argv[len(words):])
    try:
        return int(module.run(args) or 0)
    except (UsageError, FileNotFoundError, ValueError) as err:
        # Errors a user can act on: say what was wrong, no traceback (MMKV_DEBUG=1 shows it).
        if os.environ.get("MMKV_DEBUG"):
            raise
        print(f"mmkv {' '.join(words)}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

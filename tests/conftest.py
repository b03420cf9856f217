"""Fixtures shared by several test files: single-threaded torch for the tiny models, and the tiny causal Wan DiT with
a text context."""

from __future__ import annotations

import os

import pytest
import torch

# One Triton mode per pytest process, chosen before any test module imports a kernel (a kernel is interpreted or
# compiled from the moment its module is imported). Without CUDA the interpreter runs the kernels on CPU tensors (what
# CI tests). With CUDA they compile: the gpu-marked tests run them (`pytest -m gpu`) and the interpreter-only modules
# skip, instead of turning every kernel of the process into the interpreter's; TRITON_INTERPRET=1 runs those instead.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

# Model code is imported inside the fixtures: a conftest is imported before every test module, and some modules
# read TRITON_INTERPRET before anything imports triton.


@pytest.fixture(scope="module")
def one_thread():
    """torch.set_num_threads(1) for a module (restored after): on tiny tensors and models, intra-op thread start-up
    and synchronisation cost more than they save, and the CI machine has two cores. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

@pytest.fixture(scope="module")
def interpreter_scalar_index():
    """Triton 3.6's interpreter turns kernel scalars into 1-element arrays and loops over them with int(array), which
    numpy >= 2.4 refuses ('only 0-dimensional arrays ...'); read the one element instead (test-only shim, for the
    interpreter modules whose kernels loop over a scalar bound: `pytest.mark.usefixtures`)."""
    import numpy as np
    from triton.runtime import interpreter

    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4):
        yield
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched
    yield
    interpreter._patch_lang_tensor = original

@pytest.fixture
def through_the_seam(monkeypatch):
    """run(kernel, q, segments) -> (fused, decoded, codec names the seam asked for): `mmkv.attention.attend` over the
    encoded segments plus a native window (9 tokens) and a current block (1 token), once with `find_kernel` pinned
    to `kernel` and once down the decode path."""
    import mmkv.attention as attn
    from mmkv.attention import Segment

    def run(kernel, q, segments):
        b, h, d = q.shape[0], segments[0].k_enc.shape[1], q.shape[-1]
        gen = torch.Generator().manual_seed(14)
        native = Segment(k=torch.randn(b, h, 9, d, generator=gen), v=torch.randn(b, h, 9, d, generator=gen))
        k_cur, v_cur = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
        used = []

        def find(k_codec, v_codec, device):
            used.append(k_codec.name)
            return kernel

        monkeypatch.setattr(attn, "find_kernel", find)
        fused = attn.attend(q, segments + [native], k_cur, v_cur, backend="auto")
        decoded = attn.attend(q, segments + [native], k_cur, v_cur, backend="decode")
        return fused, decoded, used

    return run


@pytest.fixture(scope="module")
def dit():
    """The tiny causal Wan DiT (seed 3), shared read-only by a module's tests."""
    from mmkv.pipelines.wan.tiny import tiny_dit

    return tiny_dit(seed=3)


@pytest.fixture(scope="module")
def context():
    """A text-encoder context [1, 16, text_dim] from a fixed private generator."""
    from mmkv.pipelines.wan.tiny import TINY_DIT

    return torch.randn(1, 16, TINY_DIT["text_dim"], generator=torch.Generator().manual_seed(11))

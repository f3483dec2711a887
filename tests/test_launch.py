"""Fast launches (:mod:`kvtune.kernels.launch`): keyed at least as finely as Triton specializes, and on a GPU
the same results as the JIT's own launches, including where an argument's specialization changes."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from kvtune.kernels import launch as fast
from kvtune.tests.triton_testlib import HAS_CUDA, INTERPRETING


def _triton(value: object) -> tuple[object, ...]:
    return tuple(native_specialize_impl(BaseBackend, value, False, True, True))


def _values() -> list[object]:
    ints = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
            2**63 - 16, 2**63, 2**64 - 16]  # fmt: skip
    base = torch.zeros(64, dtype=torch.float16)
    tensors = [
        base,
        base[1:],
        base[8:],
        torch.zeros(8, dtype=torch.int32),
        torch.zeros(8, dtype=torch.uint8)[3:],
    ]
    return [*ints, True, False, 0.5, 1.0, None, *tensors]


def test_the_key_is_never_coarser_than_tritons_specialization() -> None:
    """Two arguments that Triton specializes apart never share a key (else a kept kernel would run where
    the JIT compiles another); ints are keyed apart also where Triton would share one kernel."""
    values = _values()
    for a, b in itertools.combinations(values, 2):
        if _triton(a) != _triton(b):
            assert fast.arg_key(a, False) != fast.arg_key(b, False), (a, b, _triton(a), _triton(b))


def test_compile_time_values_are_keyed_by_value_and_type() -> None:
    assert fast.arg_key(1, True) != fast.arg_key(True, True)
    assert fast.arg_key(2, True) != fast.arg_key(3, True)
    assert fast.arg_key((1, 2), True) == fast.arg_key((1, 2), True)
    marker = object()
    assert fast.arg_key(marker, True) == fast.arg_key(marker, True) != fast.arg_key(object(), True)
    assert fast.arg_key("x", False) is None  # a type this module does not key: the JIT's path


def test_one_loop_keys_each_argument_as_arg_key_does() -> None:
    """The launch's own loops (tensors and ints by exact type, scalars without a call) give the keys that
    ``arg_key`` and ``_value_key`` give one by one; a tensor off the GPU or an unkeyed type: the JIT's
    path."""
    values = [*_values(), torch.nn.Parameter(torch.zeros(4)), (1, 2), (1, True), (1, 1.0), ((1, 2), 3), ()]
    runtime = [v for v in values if not isinstance(v, tuple)]
    want = tuple(fast.arg_key(v, False) for v in runtime)
    assert fast._runtime_key(tuple(runtime), (False,) * len(runtime), cuda_only=False) == want
    assert fast._runtime_key((torch.zeros(4),), (False,)) is None  # a CPU tensor
    assert fast._runtime_key((1, "x"), (False, False), cuda_only=False) is None
    assert fast._runtime_key(((1, True),), (True,), cuda_only=False) == (fast.arg_key((1, True), True),)
    kwargs = {f"K{i}": v for i, v in enumerate(values)}
    assert fast._kwargs_key(kwargs) == tuple((n, fast._value_key(v)) for n, v in kwargs.items())
    tuples = [(1, 2), (1, True), (1, 1.0), (True, 2), ((1, 2), 3), ((1, True), 3), (), (1, 2, 3)]
    for a, b in itertools.combinations(tuples, 2):  # tuples that compile apart never share a key
        assert fast._value_key(a) != fast._value_key(b), (a, b)
    assert fast._value_key((1, 2)) == fast._value_key((1, 2))


@pytest.mark.gpu
def test_fast_launches_give_the_jits_results_gpu() -> None:
    """The fused add + RMSNorm and the seal through kept launches, with aligned and misaligned inputs in
    turn (each specializes apart), against the kernels launched by the JIT each time."""
    if not HAS_CUDA or INTERPRETING:
        pytest.skip("needs a CUDA GPU (and no TRITON_INTERPRET)")
    from kvtune.kernels.triton_elementwise import add_rms_norm_triton

    if not fast.enabled():
        pytest.skip("KVTUNE_FAST_LAUNCH=0 in the environment: nothing is kept")
    torch.manual_seed(0)
    fast.clear()
    hidden = 200
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    flat = torch.randn(8 * hidden + 8, device="cuda", dtype=torch.bfloat16)
    rows = []
    for off in (0, 1, 0, 3, 8, 0):  # offsets of 0, 2, 6 and 16 bytes: x aligned and not
        x = flat[off : off + 4 * hidden].view(4, hidden)  # a view: its address as the offset puts it
        delta = torch.randn(4, hidden, device="cuda", dtype=torch.bfloat16)
        rows.append((off, delta, add_rms_norm_triton(x, delta, weight, 1e-6)))
    assert len(fast._entries) >= 2, "aligned and misaligned inputs keep two launches"
    fast.clear()
    enabled = fast.enabled
    try:
        fast.enabled = lambda: False  # type: ignore[assignment,method-assign]
        for off, delta, (s, out) in rows:
            x = flat[off : off + 4 * hidden].view(4, hidden)
            s_jit, out_jit = add_rms_norm_triton(x, delta, weight, 1e-6)
            torch.testing.assert_close(s, s_jit, rtol=0, atol=0)
            torch.testing.assert_close(out, out_jit, rtol=0, atol=0)
    finally:
        fast.enabled = enabled  # type: ignore[method-assign]


def test_a_runtime_argument_by_keyword_takes_the_jits_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime argument passed by keyword would be kept by value with the launch: such a launch is never
    kept (nor is one on a CPU tensor); every such call reaches the JIT."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, n, BLOCK: tl.constexpr) -> None:  # pragma: no cover (never compiled here)
        pass

    constexpr, _, runtime = fast._params(_k)
    assert constexpr == (False, False, True) and runtime == {"x_ptr", "n"}
    calls = []
    monkeypatch.setattr(type(_k), "__getitem__", lambda self, grid: lambda *a, **k: calls.append((a, k)))
    fast.clear()
    fast.launch(_k, (1,), torch.zeros(4), n=4, BLOCK=16)
    fast.launch(_k, (1,), torch.zeros(4), 4, BLOCK=16)  # a CPU tensor
    assert len(calls) == 2 and not fast._entries

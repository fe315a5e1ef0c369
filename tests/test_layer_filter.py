"""The default layer filter: dims in multiples of 16 and the cost model's prediction per layer.

`fp8jax.lowering.break_even.layer_times` is the cost model's prediction of the kernels
a dense layer adds to a train step; here it is checked against the roofline written out
by hand, and (hopper) against what deviceless H100 compiles of the layer's step predict.
The filter's boundaries are checked on crafted shapes one step of 16 on either side.
"""
import dataclasses

import pytest

from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.flax.layer_filter import (BREAK_EVEN_SIZE, DIM_MULTIPLE, CostModelFilter, LayerInfo,
                                      check_layer_filter, chosen, cost_model_of,
                                      default_layer_filter)
from fp8jax.lowering.break_even import (DECISION_TOKENS, break_even_size, compiled_layer_steps,
                                        layer_times)
from fp8jax.lowering.cost import H200, CostConstants

T = BREAK_EVEN_SIZE
C = CostConstants()


def layer(in_features, out_features):
  in_features, out_features = tuple(in_features), tuple(out_features)
  return LayerInfo(path=("layer",), kind="Dense", kernel_shape=in_features + out_features,
                   in_features=in_features, out_features=out_features)


def _roofline(flops, nbytes, rate):
  return max(flops / rate, nbytes / C.hbm_bytes_per_s) + C.kernel_overhead_s


def test_layer_times_are_the_roofline_of_each_kernel_written_out():
  m, k, n = 4096, 768, 3072
  times = layer_times(m, k, n)
  f = 2 * m * k * n
  bf16, fp8 = C.bf16_gemm_flops_per_s, C.fp8_gemm_flops_per_s
  assert times.bf16 == pytest.approx({
      "weight": _roofline(0, 4 * k * n + 2 * k * n, 1),       # f32 read, bf16 written
      "fprop": _roofline(f, 2 * (m * k + k * n + m * n), bf16),
      "dgrad": _roofline(f, 2 * (m * n + n * k + m * k), bf16),
      "wgrad": _roofline(f, 2 * (k * m + m * n + k * n), bf16)}, rel=1e-12)
  assert times.fp8 == pytest.approx({
      "weight": _roofline(0, 4 * k * n + 2 * k * n, 1),       # f32 read, both FP8 layouts
      "x": _roofline(0, 2 * m * k + 2 * m * k, 1),
      "grad": _roofline(0, 2 * m * n + 2 * m * n, 1),
      "scale_update": C.kernel_overhead_s,
      "fprop": _roofline(f, m * k + k * n + 2 * m * n, fp8),  # FP8 in, bf16 out
      "dgrad": _roofline(f, m * n + n * k + 2 * m * k, fp8),
      "wgrad": _roofline(f, k * m + m * n + 2 * k * n, fp8)}, rel=1e-12)
  assert times.speedup == pytest.approx(sum(times.bf16.values()) / sum(times.fp8.values()))


def test_break_even_size_is_the_cost_models_at_the_decision_tokens():
  assert (DECISION_TOKENS, break_even_size()) == (4096, T)
  assert layer_times(DECISION_TOKENS, T, T).fp8_pays
  assert not layer_times(DECISION_TOKENS, T - DIM_MULTIPLE, T - DIM_MULTIPLE).fp8_pays
  # The figures BREAK_EVEN_SIZE's comment gives: M = K = N, an H200, a rolled layer loop.
  assert break_even_size(tokens=None) == 1360
  assert break_even_size(constants=H200) == 800
  assert break_even_size(constants=dataclasses.replace(
      C, kernel_overhead_s=C.loop_kernel_overhead_s)) == 1296


def test_a_layer_chosen_at_the_decision_tokens_gains_at_every_larger_step():
  # What DECISION_TOKENS's comment claims, on a grid of K and N (multiples of 16 up to 8192).
  sides = range(DIM_MULTIPLE, 8193, 16 * DIM_MULTIPLE)
  chosen_shapes = [(k, n) for k in sides for n in sides
                   if layer_times(DECISION_TOKENS, k, n).fp8_pays]
  assert len(chosen_shapes) > 200  # the check is not vacuous
  for tokens in (DECISION_TOKENS + DIM_MULTIPLE, 8192, 32768, 2**20):
    slower = [s for s in chosen_shapes if not layer_times(tokens, *s).fp8_pays]
    assert not slower, (tokens, slower[:5])


def test_a_square_layer_is_converted_at_the_break_even_size_and_not_one_step_below():
  assert T % DIM_MULTIPLE == 0
  assert default_layer_filter(layer([T], [T]))
  assert not default_layer_filter(layer([T - DIM_MULTIPLE], [T - DIM_MULTIPLE]))


def test_the_choice_is_symmetric_in_k_and_n_and_follows_each_shape():
  # A lopsided layer pays where the square of the same harmonic mean does: (720, 1872) has
  # harmonic mean exactly T, and the cost model converts it (1.15 us saved at 4096 tokens).
  assert 2 * 720 * 1872 == T * (720 + 1872)
  assert default_layer_filter(layer([720], [1872])) and default_layer_filter(layer([1872], [720]))
  # One step below the square on one side only: K = T, N = T - 16 is predicted slower.
  assert not default_layer_filter(layer([T], [T - DIM_MULTIPLE]))
  assert not default_layer_filter(layer([T - DIM_MULTIPLE], [T]))
  # A thin layer with four square break-even layers' worth of weights still does not pay.
  assert not default_layer_filter(layer([T // 4], [16 * T]))


def test_dims_that_are_not_multiples_of_16_are_skipped_even_when_large():
  big = 4 * T
  assert default_layer_filter(layer([big], [big]))
  assert not default_layer_filter(layer([big + DIM_MULTIPLE // 2], [big]))
  assert not default_layer_filter(layer([big], [big + DIM_MULTIPLE // 2]))
  assert not default_layer_filter(layer([big + 1], [big + 1]))


def test_multi_dim_features_count_as_the_gemm_they_fold_into():
  # DenseGeneral / Einsum: K and N are the products of the contracted and output dims, the
  # sizes of the 2-D GEMM. Heads of 8 x 2T/8 fold into N = 2T.
  info = layer([T], [8, 2 * T // 8])
  assert (info.k, info.n) == (T, 2 * T)
  assert default_layer_filter(info)
  assert not default_layer_filter(layer([T], [8, 2 * T // 8 + 1]))  # N = 2T + 8


def test_a_cost_model_filter_for_more_tokens_or_an_h200_converts_smaller_layers():
  side = 928  # below T: slower at 4096 tokens on an H100, faster at 8192 or on an H200
  assert not default_layer_filter(layer([side], [side]))
  assert CostModelFilter(tokens=8192)(layer([side], [side]))
  assert not CostModelFilter(tokens=8192)(layer([side - DIM_MULTIPLE], [side - DIM_MULTIPLE]))
  assert CostModelFilter(constants=H200)(layer([side], [side]))
  assert cost_model_of(default_layer_filter) == CostModelFilter()
  assert cost_model_of(CostModelFilter(tokens=8192)).tokens == 8192
  assert cost_model_of(lambda info: True) is None


def test_the_explanation_gives_the_predicted_times_and_the_reason():
  small, big = layer([T - DIM_MULTIPLE], [T - DIM_MULTIPLE]), layer([2 * T], [2 * T])
  times = layer_times(DECISION_TOKENS, 2 * T, 2 * T)
  assert CostModelFilter().explain(big) == (
      f"(K={2 * T}, N={2 * T}: {times.fp8_s * 1e6:.1f} us in FP8, {times.bf16_s * 1e6:.1f} us "
      f"in bf16 at 4096 tokens, {times.speedup:.3f}x)")
  assert CostModelFilter().explain(small).endswith(
      "x: its casts cost more than its GEMMs save)")
  assert CostModelFilter().explain(layer([24], [32])) == "(K=24, N=32: not multiples of 16)"
  assert CostModelFilter().times(layer([24], [32])) is None


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(tokens=0), ValueError, r"tokens=0 must be a positive int"),
    (dict(tokens=True), ValueError, r"tokens=True must be a positive int"),
    (dict(constants={"hbm_bytes_per_s": 1e12}), TypeError,
     "must be a fp8jax.lowering.CostConstants"),
])
def test_a_cost_model_filter_rejects_bad_settings(kwargs, error, message):
  with pytest.raises(error, match=message):
    CostModelFilter(**kwargs)


@pytest.mark.parametrize("args, message", [
    ((0, 16, 16), "m=0 must be an integer >= 1"),
    ((16, 16.0, 16), "k=16.0 must be an integer >= 1"),
])
def test_layer_times_rejects_shapes_that_are_not_positive_ints(args, message):
  with pytest.raises(ValueError, match=message):
    layer_times(*args)


def test_break_even_size_says_when_fp8_never_pays():
  with pytest.raises(ValueError, match="not predicted to pay for any square layer up to n=256"):
    break_even_size(high=256)


def test_check_layer_filter_names_the_argument_and_the_fix():
  with pytest.raises(TypeError, match="layer_filter must be a function.*got str"):
    check_layer_filter("head")
  check_layer_filter(default_layer_filter)
  check_layer_filter(CostModelFilter(tokens=8192))


def test_a_filter_must_return_a_bool():
  assert chosen(lambda info: True, layer([16], [16])) is True
  with pytest.raises(TypeError, match=r"layer_filter returned NoneType None for layer \('layer',\)"):
    chosen(lambda info: None, layer([16], [16]))


_MISSING = deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
@pytest.mark.parametrize("m, k, n, fp8_faster", [
    (DECISION_TOKENS, T, T - DIM_MULTIPLE, False), (DECISION_TOKENS, T, T, True)])
def test_layer_times_are_what_compiled_programs_predict_fp8_to_change(m, k, n, fp8_faster):
  """The FP8 and bf16 steps of one layer, compiled for an H100 (2 compiles), differ by the
  kernels `layer_times` lists: at the break-even size the compiled programs too put FP8
  just ahead of bf16, and just behind it one step of N below."""
  fp8, bf16 = compiled_layer_steps(m, k, n)
  times = layer_times(m, k, n)
  # Within 0.5% of the layer's bf16 time: the state update and the GEMMs' scale operands
  # move a few bytes that the prediction leaves out (measured: 0.01 us apart).
  assert bf16.time_s - fp8.time_s == pytest.approx(times.bf16_s - times.fp8_s,
                                                   abs=0.005 * times.bf16_s)
  assert (fp8.time_s <= bf16.time_s) == times.fp8_pays == fp8_faster

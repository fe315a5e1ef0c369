"""The default layer filter: dims in multiples of 16 and the cost model's break-even size.

The crafted shapes sit exactly on each rule's boundary and one step past it;
the boundaries are derived here from the rules' definitions (multiples of 16,
harmonic mean of K and N at least BREAK_EVEN_SIZE). The hopper test recomputes
the cost model's predictions that BREAK_EVEN_SIZE was taken from.
"""
import pytest

from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.flax.layer_filter import (BREAK_EVEN_SIZE, DIM_MULTIPLE, LayerInfo,
                                      check_layer_filter, chosen, default_layer_filter)
from fp8jax.lowering.break_even import break_even_size

T = BREAK_EVEN_SIZE


def layer(in_features, out_features):
  in_features, out_features = tuple(in_features), tuple(out_features)
  return LayerInfo(path=("layer",), kind="Dense", kernel_shape=in_features + out_features,
                   in_features=in_features, out_features=out_features)


def test_a_square_layer_is_converted_at_the_break_even_size_and_not_one_step_below():
  assert T % DIM_MULTIPLE == 0
  assert default_layer_filter(layer([T], [T]))
  assert not default_layer_filter(layer([T - DIM_MULTIPLE], [T - DIM_MULTIPLE]))


def _non_square_at_the_threshold():
  """The least lopsided (K, N), K < N, both multiples of 16, with 2KN / (K + N) = T exactly:
  N = T K / (2K - T) for K between T/2 and T."""
  for k in range(T - DIM_MULTIPLE, T // 2, -DIM_MULTIPLE):
    n, remainder = divmod(T * k, 2 * k - T)
    if not remainder and n % DIM_MULTIPLE == 0:
      return k, n
  raise AssertionError(f"no non-square layer of multiples of 16 has harmonic mean {T}")


def test_a_non_square_layer_is_converted_exactly_from_harmonic_mean_equal_to_the_threshold():
  k, n = _non_square_at_the_threshold()  # (720, 1872) for T = 1040
  assert 2 * k * n == T * (k + n) and k % DIM_MULTIPLE == n % DIM_MULTIPLE == 0 and k != n
  assert default_layer_filter(layer([k], [n]))
  assert default_layer_filter(layer([n], [k]))  # the rule is symmetric in K and N
  assert not default_layer_filter(layer([k], [n - DIM_MULTIPLE]))
  assert not default_layer_filter(layer([k - DIM_MULTIPLE], [n]))


def test_a_product_above_the_square_but_a_thin_side_is_not_converted():
  # K * N = 4 T^2 is four square break-even layers' worth of weights, but K = T / 4:
  # harmonic mean 2 * (T/4) * 16T / (T/4 + 16T) < T / 2.
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


def test_check_layer_filter_names_the_argument_and_the_fix():
  with pytest.raises(TypeError, match="layer_filter must be a function.*got str"):
    check_layer_filter("head")
  check_layer_filter(default_layer_filter)


def test_a_filter_must_return_a_bool():
  assert chosen(lambda info: True, layer([16], [16])) is True
  with pytest.raises(TypeError, match=r"layer_filter returned NoneType None for layer \('layer',\)"):
    chosen(lambda info: None, layer([16], [16]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(low=0), "low=0 must be a positive integer"),
    (dict(low=24), "multiples of multiple=16"),
    (dict(low=64, high=32), "low <= high"),
])
def test_break_even_size_rejects_a_bad_search_range_before_compiling(kwargs, message):
  with pytest.raises(ValueError, match=message):
    break_even_size(**kwargs)


_MISSING = deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_break_even_size_is_where_the_cost_model_first_predicts_fp8_no_slower_than_bf16():
  # The search over [T - 16, T] compiles both ends (4 deviceless H100 compiles).
  result = break_even_size(low=T - DIM_MULTIPLE, high=T)
  assert result.size == T, result.speedups
  assert result.speedups[T - DIM_MULTIPLE] < 1.0 <= result.speedups[T], result.speedups

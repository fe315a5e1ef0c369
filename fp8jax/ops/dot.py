"""`fp8_dot_general`: `lax.dot_general` with FP8 operands in forward and backward.

Forward:  out = (q(x) . q(kernel)) / (s_x * s_kernel)           (fprop GEMM)
Backward: dx  = (q(g) . q(kernel)^T) / (s_g * s_kernel)          (dgrad GEMM)
          dk  = (q(x)^T . q(g)) / (s_x * s_g)                    (wgrad GEMM)

with `q(t) = saturate(t * s_t)` in the role's FP8 format (E4M3 for x and
kernel; E5M2 for the output gradient g under "hybrid"). The products
accumulate in float32 and the two descales `1 / s` (stored in the meta as
`scale_inv`) are applied to the float32 accumulator before the one rounding to
the output dtype.

What this compiles to on Hopper (the lean path, see `fp8jax.lowering.cost`):
when the dot is a plain matrix product once reshaped (`fp8_dense`, the
projections of `fp8_einsum`), each of x, kernel and g is quantized by one
kernel that also writes its transposed FP8 copy and records its amax
(`fp8jax.ops.fused_kernels`; under delayed scaling the three casts hand each
other their amax buffers, so nothing else launches for them), and the three
GEMMs read those copies in the layout cuBLASLt's FP8 GEMM wants, so XLA adds no
transpose. Current scaling needs each tensor's amax before its cast: a reduction
XLA computes in the kernel that writes the tensor where it can (or `x_amax`, from
x's producer), from which the cast kernel makes the scale and the rest itself.
The same kernels also return each GEMM's combined descale, and each GEMM is one
`__cublas$lt$matmul$f8` that applies it as its alpha and writes the output dtype
straight from its float32 accumulator (`scaled_matmul_nt`): no kernel reads a
GEMM's output before its consumer. Other dimension numbers (batch
dims) take the general path, where XLA places the transposes.

State: the function returns the meta with the amaxes of x and kernel recorded;
the gradient role's amax is recorded in the cotangent of `meta` during the
backward pass, max-combined with the cotangent flowing in from later uses.
Threading the meta (use -> new meta -> next use) therefore gives the max over
all uses in both directions; see `fp8jax.value_and_grad`.

Recipe options: GEMMs named in a recipe's `high_precision` run as
`lax.dot_general` in the input dtype on the unquantized operands (such recipes
take the general path, which keeps those operands as residuals); amaxes are
recorded for every role all the same. Per-row and per-block recipes
(`RowwiseScaling`, `BlockScaling`, `MXFP8Scaling`) run in
`fp8jax.ops.fine_grained_dot`.

The state goes down one way: this op checks it (`fp8jax.core.meta`), asks its
recipe (`fp8jax.core.recipes`) and hands the role states' arrays to the casts
(`fp8jax.ops.cast`, `fp8jax.ops.fused_kernels`); the new state comes back from the
custom VJP.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fp8jax.core.meta import (DotMeta, amaxes_unbatched_like, check_dot_meta, descale,
                              record_amax)
from fp8jax.core.quantize import amax, amax_max, quantize
from fp8jax.core.validation import check_floating
from fp8jax.mesh import explicit as explicit_mesh
from fp8jax.mesh.axes import match_operand_axes, varying_axes
from fp8jax.mesh.partitioning import shard_local_gemm, vmapped_as
from fp8jax.ops import fused_kernels, saved_activations, stacked_weights, weight_reuse
from fp8jax.ops.cast import amax_of_whole, cast_scale, quantize_with_meta
from fp8jax.ops.fine_grained_dot import fine_grained_dot_general
from fp8jax.ops.fused_kernels import cast_from_amax, cast_in_chain
from fp8jax.ops.guards import check_threaded, refuse_split_state, reverse_mode_only

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def fp8_dot_general(x: jax.Array, kernel: jax.Array, meta: DotMeta,
                    dimension_numbers: DimensionNumbers, *,
                    x_amax: jax.Array | None = None) -> tuple[jax.Array, DotMeta]:
  """FP8 `lax.dot_general(x, kernel, dimension_numbers)`.

  Args:
    x: floating array (bf16, f16 or f32), the activation.
    kernel: floating array, the weight.
    meta: the `DotMeta` of this matmul (from `fp8jax.init_dot_meta`).
    dimension_numbers: as for `jax.lax.dot_general`:
      `((x_contracting, kernel_contracting), (x_batch, kernel_batch))`.
    x_amax: optional float32[] `max|x|`, exact (NaN if x holds one), computed by the op
      that wrote x in the same pass (`fp8jax.rms_norm` / `fp8jax.gelu` with
      `return_amax=True`). Current scaling then takes x's scale from it: x is read
      once, by its cast, instead of twice (an amax pass, then the cast). On its own
      `fp8_dot_general` cannot know max|x| of an arbitrary x without reading it, so
      without `x_amax` current scaling keeps that pass. Delayed scaling (x's amax is
      recorded by the cast itself), the per-row / per-block recipes and dots with
      batch dims ignore it.

  Returns:
    (out, new_meta): `out` has `lax.dot_general`'s shape and `x`'s dtype
    (accumulated in float32); `new_meta` has this use's amaxes recorded.
  """
  check_floating(x, "x")
  check_floating(kernel, "kernel")
  refuse_split_state(meta, "meta")
  check_dot_meta(meta, "meta")
  check_threaded(meta, "fp8_dot_general")
  _check_x_amax(x_amax)
  dims = normalize_dimension_numbers(dimension_numbers, x.shape, kernel.shape)
  fine_grained = meta.recipe.per_operand
  layout = matrix_layout(dims, x.shape, kernel.shape, explicit_mesh.explicit_spec(x),
                         explicit_mesh.explicit_spec(kernel))
  if fine_grained or meta.recipe.high_precision:
    # Per-row / per-block recipes have their own GEMMs; high-precision GEMMs take the
    # general path, which keeps the unquantized operands they need.
    layout = None
  reused = _reused_kernel(kernel, meta.kernel, layout) if not varying_axes(x, kernel) else None
  x, kernel, meta = match_operand_axes(x, kernel, meta)  # inside shard_map; fp8jax.mesh.axes
  with reverse_mode_only("An FP8 matmul (fp8jax.fp8_dot_general, under fp8_dense, fp8_einsum "
                         "and the Flax FP8 layers)", "jax.lax.dot_general / jnp.einsum"):
    if fine_grained:
      return fine_grained_dot_general(x, kernel, meta, dims)
    if x_amax is not None:
      x_amax = jnp.asarray(x_amax, jnp.float32)
    return _fp8_dot(x, kernel, meta, reused, x_amax, dims, jnp.dtype(kernel.dtype), layout)


def prologue_path(recipe) -> bool:
  """Whether FP8 ops under `recipe` run the matrix path's per-tensor casts, which can cast
  a function of their input made in the kernel (a prologue: `fp8jax.ops.norm_dense`,
  `fp8jax.ops.mlp`, `fp8jax.ops.norm_qkv_rope`): delayed and current scaling, one scale
  per tensor and FP8 GEMMs for all three products. Current scaling first reduces the
  function's amax over the prologue's inputs (`fused_kernels.prologue_amax`).

  Returns:
    True for such a recipe.
  """
  return not (recipe.per_operand or recipe.high_precision)


def _check_x_amax(x_amax) -> None:
  if x_amax is None:
    return
  dtype = jnp.result_type(x_amax)
  if jnp.ndim(x_amax) != 0 or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
        f"x_amax must be one float, max|x| over the whole x (float32[]); got shape "
        f"{jnp.shape(x_amax)} and dtype {dtype}. Pass the amax that fp8jax.rms_norm or "
        "fp8jax.gelu return with return_amax=True, or None to let current scaling measure x.")


def _reused_kernel(kernel, meta, layout):
  """The kernel's FP8 copies from earlier in the step, under `fp8jax.ops.stacked_weights`'
  `supplying` or `fp8jax.ops.weight_reuse` (a `weight_reuse.ReusedKernel`); or None.

  While collecting, the kernel is quantized here, outside the op's custom VJP,
  so that its arrays belong to the trace that will reuse them.
  """
  supplied = stacked_weights.supplied(kernel, layout)
  if supplied is not None:  # cast before the loop over layers, with this layer's scale
    return supplied
  cache = weight_reuse.current()
  if cache is None or layout is None or not cache.applies_here():
    return None
  if not cache.collecting:
    return cache.take(kernel, meta)
  fresh = dataclasses.replace(meta, amax=jnp.zeros_like(meta.amax))
  cast, scale_inv, _ = _quantize_matrix(
      explicit_mesh.to_matrix(kernel, layout.n_contract), fresh, kernel, None)
  arrays = weight_reuse.ReusedKernel(cast.q, cast.q_t, amax=cast.amax, scale_inv=scale_inv)
  cache.add(weight_reuse.primal(kernel), meta, arrays)
  return arrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _fp8_dot(x, kernel, meta, reused, x_amax, dims, kernel_dtype, layout):
  out, new_meta, _ = _fp8_dot_fwd_impl(x, kernel, meta, reused, x_amax, dims, layout)
  return out, new_meta


def _fp8_dot_fwd_impl(x, kernel, meta, reused, x_amax, dims, layout):
  if layout is not None:
    out, new_meta, residuals, _ = matrix_fwd(x, kernel, meta, reused, layout, x_amax)
  else:
    out, new_meta, residuals = _general_fwd(x, kernel, meta, dims)
  # Under jax.vmap with one state: the whole batch's amaxes (fp8jax.core.quantize.unbatched_like).
  return out, amaxes_unbatched_like(meta, new_meta), residuals


def _general_fwd(x, kernel, meta, dims):
  qx, scale_x, meta_x = quantize_with_meta(x, meta.x)
  qk, scale_k, meta_k = quantize_with_meta(kernel, meta.kernel)
  scale_inv_x, scale_inv_k = descale(meta.x, scale_x), descale(meta.kernel, scale_k)
  high = meta.recipe.high_precision
  # Named scopes label the three GEMMs in HLO metadata (fp8jax.lowering reads them).
  with jax.named_scope("fp8_fprop"):
    if "fprop" in high:  # in x's dtype, as the FP8 product is returned
      out = explicit_mesh.dot_general(x, kernel.astype(x.dtype), dims)
    else:
      out = scaled_dot(qx, qk, scale_inv_x, scale_inv_k, dims, x.dtype)
  new_meta = dataclasses.replace(meta, x=meta_x, kernel=meta_k)
  # A high-precision backward GEMM reads the unquantized operand instead of its FP8 copy.
  if "wgrad" not in high:
    qx, scale_inv_x = saved_activations.named(qx, scale_inv_x, "dense_x")
  residuals = (x if "wgrad" in high else qx, kernel if "dgrad" in high else qk,
               scale_inv_x, scale_inv_k, meta.grad)
  return out, new_meta, residuals


def _fp8_dot_fwd(x, kernel, meta, reused, x_amax, dims, kernel_dtype, layout):
  out, new_meta, residuals = _fp8_dot_fwd_impl(x, kernel, meta, reused, x_amax, dims, layout)
  return (out, new_meta), residuals


def _fp8_dot_bwd(dims, kernel_dtype, layout, residuals, cotangents):
  # The reused FP8 copies of the kernel get no gradient (the kernel's is dk): None.
  reused_cotangent = None
  g, meta_cotangent = cotangents
  if layout is not None:
    dx, dk, grad_cotangent = matrix_bwd(layout, residuals, g, meta_cotangent.grad,
                                         kernel_dtype)
    return (dx, dk, amaxes_unbatched_like(
        meta_cotangent, dataclasses.replace(meta_cotangent, grad=grad_cotangent)),
            reused_cotangent, None)

  qx, qk, scale_inv_x, scale_inv_k, grad_meta = residuals
  high = grad_meta.recipe.high_precision
  g_amax = amax(g)
  scale_g = cast_scale(grad_meta, g_amax, like=g)
  scale_inv_g = descale(grad_meta, scale_g)
  qg = quantize(g, scale_g, grad_meta.fmt)

  # On an explicit-axis mesh each gradient is sharded as its primal (qx, qk have
  # x's and the kernel's shardings); see fp8jax.mesh.explicit.
  dgrad_dims, dgrad_perm = dgrad_dimension_numbers(dims, qx.ndim, qk.ndim)
  dx_spec = explicit_mesh.spec_before_transpose(explicit_mesh.explicit_spec(qx), dgrad_perm)
  with jax.named_scope("fp8_dgrad"):
    if "dgrad" in high:  # qk is the unquantized kernel
      dx = explicit_mesh.dot_general(g, qk.astype(g.dtype), dgrad_dims, dx_spec)
    else:
      dx = scaled_dot(qg, qk, scale_inv_g, scale_inv_k, dgrad_dims, g.dtype, dx_spec)
    dx = jnp.transpose(dx, dgrad_perm)

  wgrad_dims, wgrad_perm = wgrad_dimension_numbers(dims, qx.ndim, qk.ndim)
  dk_spec = explicit_mesh.spec_before_transpose(explicit_mesh.explicit_spec(qk), wgrad_perm)
  with jax.named_scope("fp8_wgrad"):
    if "wgrad" in high:  # qx is the unquantized x
      dk = explicit_mesh.dot_general(qx, g.astype(qx.dtype), wgrad_dims,
                                     dk_spec).astype(kernel_dtype)
    else:
      dk = scaled_dot(qx, qg, scale_inv_x, scale_inv_g, wgrad_dims,
                      wgrad_dtype(g.dtype, kernel_dtype), dk_spec).astype(kernel_dtype)
    dk = jnp.transpose(dk, wgrad_perm)

  meta_in_cotangent = dataclasses.replace(
      meta_cotangent, grad=record_amax(meta_cotangent.grad, g_amax))
  # x_amax is a statistic of x, not differentiated: no cotangent (None).
  return (dx, dk, amaxes_unbatched_like(meta_cotangent, meta_in_cotangent), reused_cotangent,
          None)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


# ----- The matrix path: x [.., K] . kernel [K, ..] as one 2-D GEMM ---------------------


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
  """How a dot_general folds into `x2 [M, K] @ kernel2 [K, N]` (free reshapes only).

  Attributes:
    x_shape, kernel_shape: the operands' shapes.
    n_contract: how many trailing x axes (leading kernel axes) are contracted.
    m, k, n: the folded sizes.
  """

  x_shape: tuple[int, ...]
  kernel_shape: tuple[int, ...]
  n_contract: int
  m: int
  k: int
  n: int
  # The operands' explicit-mesh shardings (all None elsewhere), for the reshapes back.
  x_spec: tuple = ()
  kernel_spec: tuple = ()

  @property
  def out_shape(self) -> tuple[int, ...]:
    """dot_general's output shape: x's free axes, then the kernel's."""
    return (self.x_shape[:len(self.x_shape) - self.n_contract] +
            self.kernel_shape[self.n_contract:])

  @property
  def out_spec(self) -> tuple:
    """The output's sharding on an explicit mesh: x's free axes', then the kernel's."""
    return (self.x_spec[:len(self.x_shape) - self.n_contract] +
            self.kernel_spec[self.n_contract:])


def matrix_layout(dims, x_shape, kernel_shape, x_spec=None,
                  kernel_spec=None) -> MatrixLayout | None:
  """The `MatrixLayout` of `dims`, or None when the dot is not a plain matrix product.

  That is the case when there are no batch dims, x contracts its trailing axes
  and the kernel its leading axes in the same order: `fp8_dense`, and the
  projections of `fp8_einsum` such as 'bsd,dhk->bshk' or 'bshk,hkd->bsd'.
  """
  (x_contract, k_contract), (x_batch, k_batch) = dims
  n_contract = len(x_contract)
  if x_batch or k_batch or n_contract == 0:
    return None
  if tuple(x_contract) != tuple(range(len(x_shape) - n_contract, len(x_shape))):
    return None
  if tuple(k_contract) != tuple(range(n_contract)):
    return None
  return MatrixLayout(x_shape=tuple(x_shape), kernel_shape=tuple(kernel_shape),
                      n_contract=n_contract,
                      m=math.prod(x_shape[:len(x_shape) - n_contract]),
                      k=math.prod(kernel_shape[:n_contract]),
                      n=math.prod(kernel_shape[n_contract:]),
                      x_spec=tuple(x_spec or (None,) * len(x_shape)),
                      kernel_spec=tuple(kernel_spec or (None,) * len(kernel_shape)))


def _quantize_matrix(t, meta, like, partner_descales, gathered_for=None, known_amax=None,
                     packed=None, **chain):
  """FP8 copies of a 2-D `t` in both layouts, the GEMM descales, and `t`'s amax.

  Delayed scaling: one pass over t (the fused cast-transpose-amax kernel on a
  GPU). Current scaling needs t's amax before it can cast: `known_amax` (max|t|
  from t's producer), else a reduction written in jnp, which XLA computes in the
  kernel that writes t wherever that kernel is its own (an activation function, a
  norm's backward, a dtype conversion of a weight) and in a pass of its own only
  where it is not (a jit parameter, a GEMM's or a Pallas kernel's output). The
  cast kernel then makes the scale, its descale and the running amax from that
  amax itself (`fused_kernels.cast_from_amax`): no launch for a scalar.

  `chain`: how the cast's amax joins the layer's other casts
  (`fp8jax.ops.fused_kernels.cast_in_chain`: `tile_amaxes`, `accumulator`,
  `reduce`, `seeds`), and `prologue`, `prologue_inputs`: the cast quantizes the
  prologue's result (see `matrix_fwd`). Under current scaling its amax is a reduction
  of the function over the prologue's inputs (`fused_kernels.prologue_amax`): the
  result itself is not written for the cast to read back.

  Returns (cast, scale_inv, running): the `fused_kernels.Cast` (its `amax` the
  new running amax, or the tile maxima, whose reduction with `running` is the
  new running amax; under current scaling a `fused_kernels.ScaledCast`), the
  descale `1 / scale`, and the running amax before this cast (None under current
  scaling). `cast.products[i] = scale_inv * partner_descales[i]` (capped at the
  float32 max): each GEMM's one descale. `known_amax`: max|t| from t's producer
  (current scaling then skips its amax pass). `packed`: meta's scalars the casts read as
  elements of one vector (`_packed_state`), by field name, or None.
  """
  packed = packed or {}
  if meta.recipe.scales_from_tensor:
    prologue, prologue_inputs = chain.get("prologue"), chain.get("prologue_inputs", ())
    with jax.named_scope("amax"):
      if known_amax is not None:
        t_amax = known_amax
      elif prologue is not None:
        t_amax = fused_kernels.prologue_amax(t, prologue, prologue_inputs)
      else:
        t_amax = amax(t)
    cast = cast_from_amax(
        t, amax_of_whole(meta, t_amax, like), packed.get("scale", meta.scale),
        packed.get("amax", meta.amax), meta.fmt,
        margin=meta.recipe.margin, power_of_two=meta.recipe.power_of_two, recorded=t_amax,
        partner_descales=partner_descales, gathered_for=gathered_for,
        pass_through=chain.get("pass_through", ()), prologue=prologue,
        prologue_inputs=prologue_inputs, keep_groups=chain.get("keep_groups", False))
    return cast, cast.descale, None
  scale, scale_inv = packed.get("scale", meta.scale), packed.get("scale_inv", meta.scale_inv)
  running = meta.amax
  cast = cast_in_chain(
      t, scale, None if chain.get("tile_amaxes") else running, meta.fmt,
      descale=scale_inv if partner_descales is not None else None,
      partner_descales=partner_descales, gathered_for=gathered_for, **chain)
  return cast, scale_inv, running


_ROLES = ("x", "kernel", "grad")


def _packed_state(meta: DotMeta) -> dict:
  """The scalars of each role the casts read, as elements of one float32 vector.

  Where a layer's state is sliced from a stack of layers (`fused_kernels.stacked_state`),
  each scalar a cast kernel reads would be sliced out by a launch of its own: a custom
  call takes no fused slice (the 350m GPT: 624 launches a step, 26 a layer). Packed, the
  slices fuse into the one kernel that writes the vector, and the casts, forward and
  backward, read their elements in place. Delayed scaling's casts read each role's scale
  and scale_inv; current scaling's its scale (the fallback) and, but for the output
  gradient's (its cotangent's), its running amax.

  Returns:
    {role: {field: VectorElement}} for the roles "x", "kernel" and "grad".
  """
  if meta.recipe.scales_from_tensor:
    fields = {"x": ("scale", "amax"), "kernel": ("scale", "amax"), "grad": ("scale",)}
  else:
    fields = dict.fromkeys(_ROLES, ("scale", "scale_inv"))
  elements = iter(fused_kernels.packed_scalars([getattr(getattr(meta, role), field)
                                                for role in _ROLES for field in fields[role]]))
  return {role: {field: next(elements) for field in fields[role]} for role in _ROLES}


def matrix_fwd(x, kernel, meta, reused, layout, x_amax=None, x_prologue=None,
               x_prologue_inputs=(), keep_x=False):
  """The matrix path's forward: (out, new_meta, residuals, kept).

  `x_prologue`: the GEMM's input is `x_prologue.fn(x, *x_prologue_inputs)`, made by x's
  cast (`fp8jax.ops.fused_kernels.cast_in_chain`, or `cast_from_amax` under current
  scaling; `fp8jax.ops.mlp`, `fp8jax.ops.norm_dense`), each input of the folded x's shape
  [M, K], or [M, 1] or [1, K]. `keep_x`: x's cast also writes x itself (before the
  prologue) as the FP8 copy a backward pass keeps, returned as `kept`
  (`saved_activations.quantize_groups`' codes [M, K] and descales, of the folded x);
  else `kept` is None.
  """
  if x_prologue is not None and x_amax is not None:
    raise ValueError("x_amax is max|x|, not the amax of the x_prologue's result that x's cast "
                     "quantizes: pass one of them.")
  x2 = explicit_mesh.to_matrix(x, x.ndim - layout.n_contract)
  with_prologue = {} if x_prologue is None else dict(prologue=x_prologue,
                                                     prologue_inputs=tuple(x_prologue_inputs))
  if keep_x:
    with_prologue["keep_groups"] = True
  # Delayed scaling's running amaxes enter the step as its parameters or zeros:
  # buffers a cast kernel cannot max into in place (XLA would copy each first, a
  # launch for 4 bytes). So the layer's casts form a chain instead
  # (fp8jax.ops.fused_kernels.cast_in_chain): the kernel's cast writes its tile
  # maxima and a zeroed buffer for x's amax; x's cast reduces the kernel's amax from
  # those tiles and leaves a zeroed buffer for the output gradient's amax. Current
  # scaling computes its running amaxes in the step, so its casts take them as they are.
  chain = not meta.recipe.scales_from_tensor
  # x's cast also copies through the state the step's update reads (every role's
  # scale and history, the output gradient's amax): read from these copies, the
  # step's parameters die at the casts, so with the state donated the update writes
  # its results where they were instead of XLA copying each result there after it.
  # Not for state sliced from a stack of layers (`fused_kernels.stacked_state`): the
  # update reads the stack, not the per-layer copies, which would only add a slice and a
  # copy per array and layer.
  passed = () if fused_kernels.in_stacked_state() else (
      meta.x.scale, meta.x.amax_history, meta.kernel.scale, meta.kernel.amax_history,
      meta.grad.scale, meta.grad.amax_history, meta.grad.amax)
  packed = (_packed_state(meta) if fused_kernels.in_stacked_state()
            else dict.fromkeys(_ROLES))
  if reused is not None:
    # A weight cast before the loop over layers (`fp8jax.ops.stacked_weights`) or before
    # the microbatch loop (`fp8jax.ops.weight_reuse`): x's cast starts the chain.
    qk, qk_t, scale_inv_k = reused.q, reused.q_t, reused.scale_inv
    if scale_inv_k is None:
      scale_inv_k = (packed["kernel"] or {}).get("scale_inv", meta.kernel.scale_inv)
    with_seed = {} if reused.seed is None or not chain else dict(accumulator=reused.seed)
    x_cast, scale_inv_x, _ = _quantize_matrix(x2, meta.x, x, (scale_inv_k,),
                                              known_amax=x_amax, packed=packed["x"],
                                              seeds=int(chain), pass_through=passed,
                                              **with_seed, **with_prologue)
    k_amax = (reused.running_amax if reused.running_amax is not None
              else amax_max(meta.kernel.amax, reused.amax))
  elif chain:
    k_cast, scale_inv_k, k_running = _quantize_matrix(
        explicit_mesh.to_matrix(kernel, layout.n_contract), meta.kernel, kernel, None,
        gathered_for=x2, packed=packed["kernel"], tile_amaxes=True, seeds=1)
    qk, qk_t = k_cast.q, k_cast.q_t
    x_cast, scale_inv_x, _ = _quantize_matrix(
        x2, meta.x, x, (scale_inv_k,), packed=packed["x"], accumulator=k_cast.seeds[0],
        reduce=(k_cast.amax, k_running), seeds=1, pass_through=passed, **with_prologue)
    k_amax = x_cast.reduced
  else:
    k_cast, scale_inv_k, _ = _quantize_matrix(
        explicit_mesh.to_matrix(kernel, layout.n_contract), meta.kernel, kernel, None,
        gathered_for=x2, packed=packed["kernel"])
    qk, qk_t, k_amax = k_cast.q, k_cast.q_t, k_cast.amax
    x_cast, scale_inv_x, _ = _quantize_matrix(x2, meta.x, x, (scale_inv_k,),
                                              known_amax=x_amax, packed=packed["x"],
                                              pass_through=passed, **with_prologue)
  (fprop_descale,) = x_cast.products
  with jax.named_scope("fp8_fprop"):
    out = scaled_matmul_nt(x_cast.q, qk_t, fprop_descale, x.dtype)
  out = explicit_mesh.reshape(out, layout.out_shape, layout.out_spec)
  x_scale, x_history, k_scale, k_history, g_scale, g_history, g_amax = x_cast.passed or (
      meta.x.scale, meta.x.amax_history, meta.kernel.scale, meta.kernel.amax_history,
      meta.grad.scale, meta.grad.amax_history, meta.grad.amax)
  new_meta = DotMeta(
      x=dataclasses.replace(meta.x, scale=x_scale, amax_history=x_history, amax=x_cast.amax),
      kernel=dataclasses.replace(meta.kernel, scale=k_scale, amax_history=k_history,
                                 amax=k_amax),
      grad=dataclasses.replace(meta.grad, scale=g_scale, amax_history=g_history, amax=g_amax))
  # The backward pass reads x only as x^T (wgrad) and the kernel only as is (dgrad);
  # the output gradient's cast accumulates its amax into the zeroed buffer x's left.
  # Named, x's are what `saved_activations.policy()` keeps under remat (the kernel's
  # copy is recomputed from the kernel, which remat keeps, unless it was cast before the
  # loop over layers and is the layer's input).
  qx_t, scale_inv_x = saved_activations.named(x_cast.q_t, scale_inv_x, "dense_x")
  g_accumulator = (checkpoint_name(x_cast.seeds[0], saved_activations.GRAD_AMAX_SEED)
                   if chain else None)
  residuals = (qx_t, qk, scale_inv_x, scale_inv_k, meta.grad, g_accumulator, packed["grad"])
  return out, new_meta, residuals, x_cast.kept


def matrix_bwd(layout, residuals, g, grad_cotangent, kernel_dtype, g_prologue=None,
                g_prologue_inputs=()):
  """The matrix path's backward: (dx, dk, the grad role's cotangent).

  `g_prologue`: the output gradient is `g_prologue.fn(g, *g_prologue_inputs)` (each
  input of g's shape, or the FP8 copy's descales, one per row and group of 128 columns),
  made by g's cast (`fp8jax.ops.mlp`); a rotary prologue makes it
  from g = dq and dk, dv, positions, frequencies (`fp8jax.ops.norm_qkv_rope`).
  """
  qx_t, qk, scale_inv_x, scale_inv_k, grad_meta, g_accumulator, grad_packed = residuals
  n_free = g.ndim - (len(layout.kernel_shape) - layout.n_contract)
  g2 = explicit_mesh.to_matrix(g, n_free)
  with_prologue = {} if g_prologue is None else dict(
      prologue=g_prologue,
      prologue_inputs=tuple(explicit_mesh.to_matrix(t, n_free) for t in g_prologue_inputs))
  # The grad role's scale is the forward state's; its amax goes to the cotangent.
  with_running = dataclasses.replace(grad_meta, amax=grad_cotangent.amax)
  g_cast, _, _ = _quantize_matrix(g2, with_running, g, (scale_inv_k, scale_inv_x),
                                  packed=grad_packed, accumulator=g_accumulator,
                                  **with_prologue)
  qg, qg_t = g_cast.q, g_cast.q_t
  dgrad_descale, wgrad_descale = g_cast.products
  # On an explicit-axis mesh dx is sharded as x (qx_t is x^T) and dk as the kernel
  # (qk has its sharding); see fp8jax.mesh.explicit.
  with jax.named_scope("fp8_dgrad"):
    dx = scaled_matmul_nt(qg, qk, dgrad_descale, g.dtype,
                          out_spec=explicit_mesh.explicit_spec(qx_t)[::-1])
  with jax.named_scope("fp8_wgrad"):
    dk = scaled_matmul_nt(qx_t, qg_t, wgrad_descale, wgrad_dtype(g.dtype, kernel_dtype),
                          out_spec=explicit_mesh.explicit_spec(qk)).astype(kernel_dtype)
  dx = explicit_mesh.reshape(dx, layout.x_shape, layout.x_spec)
  dk = explicit_mesh.reshape(dk, layout.kernel_shape, layout.kernel_spec)
  return dx, dk, dataclasses.replace(grad_cotangent, amax=g_cast.amax)


def wgrad_dtype(g_dtype, kernel_dtype):
  """The dtype the weight-gradient GEMM writes: the narrower of the output gradient's
  and the kernel's. A float32 master weight (the Flax layers hand the op their stored
  kernel, `fp8jax.flax.master_kernel`) gets its gradient as a bf16 model's does, rounded
  to the activations' dtype by the GEMM (2 bytes written, and read by the optimizer,
  where the conversion to float32 fuses) instead of 4 each way."""
  g_dtype, kernel_dtype = jnp.dtype(g_dtype), jnp.dtype(kernel_dtype)
  return g_dtype if g_dtype.itemsize < kernel_dtype.itemsize else kernel_dtype


# ----- GEMMs with their descales -----------------------------------------------------


def scaled_matmul_nt(qa: jax.Array, qb: jax.Array, descale: jax.Array, out_dtype,
                     out_spec=None) -> jax.Array:
  """`(qa @ qb.T) * descale` in `out_dtype`; qa [P, C], qb [Q, C] FP8, descale float32[].

  `out_spec`: the product's sharding on an explicit-axis mesh (default: qa's
  rows, qb's rows; see `fp8jax.mesh.explicit`). Ignored elsewhere.

  `descale` is the product of the two operands' `scale_inv` (capped at the
  float32 max, so a zero row stays 0). Both operands contract their last
  (innermost) dim, the layout cuBLASLt's FP8 GEMM reads on Hopper, so XLA adds
  no transpose.

  On a GPU, for bf16 and f32 outputs, the product is a raw-FP8 dot with an
  `out_dtype` result times the scalar: XLA rewrites that into ONE
  `__cublas$lt$matmul$f8` that takes the descale as its float32 scale operand
  and writes `out_dtype` from its float32 accumulator, and with XLA's default
  flags the autotuner can only choose between FP8 kernels (a dot of
  dequantized bf16 operands would let it pick a bf16 GEMM). The scale operand
  stays float32 because XLA drops the scalar's round trip through `out_dtype`
  (`xla_allow_excess_precision`, on by default; turned off, the descale is
  rounded to bf16, a systematic error of up to 2**-9). f16 outputs, whose range
  could not hold the descale, and every other platform take the float32 form:
  the dot accumulates in float32, is multiplied by the descale in float32 and
  rounded once.
  """
  out_dtype = jnp.dtype(out_dtype)
  dims = (((1,), (1,)), ((), ()))

  def cublaslt_fp8(qa, qb, descale):
    product = explicit_mesh.dot_general(qa, qb, dims, out_spec,
                                        preferred_element_type=out_dtype)
    return product * descale.astype(out_dtype)

  def float32_product(qa, qb, descale):
    product = explicit_mesh.dot_general(qa, qb, dims, out_spec,
                                        preferred_element_type=jnp.float32)
    return (product * descale).astype(out_dtype)

  if out_dtype not in _FUSED_OUTPUT_DTYPES:
    return float32_product(qa, qb, descale)
  if explicit_mesh.is_explicitly_sharded(qa, qb):
    # Shardings are in the types: JAX partitions the dot, and a custom
    # partitioning rule (which sees Auto axes only) does not apply.
    per_shard = cublaslt_fp8
  else:
    per_shard = vmapped_as(shard_local_gemm(cublaslt_fp8), cublaslt_fp8)
  return jax.lax.platform_dependent(qa, qb, descale, cuda=per_shard,
                                    default=float32_product)


_FUSED_OUTPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def scaled_dot(qa: jax.Array, qb: jax.Array, scale_inv_a: jax.Array, scale_inv_b: jax.Array,
               dims, out_dtype, out_spec=None) -> jax.Array:
  """`dot_general(qa, qb) * scale_inv_a * scale_inv_b` with f8 operands, in `out_dtype`.

  The general path (batch dims): the f8 dot accumulates in float32 and the
  descales are applied one after the other, in float32, then the result is
  rounded once. Applying them one at a time keeps the result finite where their
  product would leave float32's range (tiny scales of huge tensors). `out_spec`
  as for `scaled_matmul_nt`.
  """
  product = explicit_mesh.dot_general(qa, qb, dims, out_spec,
                                      preferred_element_type=jnp.float32)
  return (product * scale_inv_a * scale_inv_b).astype(out_dtype)


def normalize_dimension_numbers(dimension_numbers, x_shape, kernel_shape):
  """Checks `dimension_numbers` against the operand shapes; returns them as int tuples."""
  try:
    (x_contract, k_contract), (x_batch, k_batch) = dimension_numbers
    dims = ((tuple(int(a) for a in x_contract), tuple(int(a) for a in k_contract)),
            (tuple(int(a) for a in x_batch), tuple(int(a) for a in k_batch)))
  except (TypeError, ValueError):
    raise ValueError(
        f"dimension_numbers={dimension_numbers!r} must be "
        "((x_contracting, kernel_contracting), (x_batch, kernel_batch)), "
        "as for jax.lax.dot_general.") from None
  (x_contract, k_contract), (x_batch, k_batch) = dims
  for name, axes, shape in (("x", x_contract + x_batch, x_shape),
                            ("kernel", k_contract + k_batch, kernel_shape)):
    if any(not 0 <= a < len(shape) for a in axes) or len(set(axes)) != len(axes):
      raise ValueError(
          f"dimension_numbers={dimension_numbers!r} names axes {axes} of {name}, which has "
          f"shape {tuple(shape)}: each axis must be distinct and in [0, {len(shape)}).")
  for kind, x_axes, k_axes in (("contracting", x_contract, k_contract),
                               ("batch", x_batch, k_batch)):
    x_sizes = tuple(x_shape[a] for a in x_axes)
    k_sizes = tuple(kernel_shape[a] for a in k_axes)
    if x_sizes != k_sizes:
      raise ValueError(
          f"{kind} dimensions do not match: x axes {x_axes} have sizes {x_sizes} but kernel "
          f"axes {k_axes} have sizes {k_sizes} (x shape {tuple(x_shape)}, kernel shape "
          f"{tuple(kernel_shape)}). Transpose or reshape one operand so they agree.")
  return dims


def _free_axes(ndim, *used):
  taken = set(a for axes in used for a in axes)
  return [a for a in range(ndim) if a not in taken]


def dgrad_dimension_numbers(dims, x_ndim, k_ndim):
  """Dimension numbers of `dot_general(g, kernel)` giving dx, and the permutation to x's layout.

  `out = dot_general(x, kernel)` lays its axes out as [batch, x free, kernel free].
  dx contracts g's kernel-free axes with the kernel's free axes; the result is
  [batch, x free, kernel contracting (ascending)] and is permuted back to x.
  """
  (x_contract, k_contract), (x_batch, k_batch) = dims
  x_free = _free_axes(x_ndim, x_contract, x_batch)
  k_free = _free_axes(k_ndim, k_contract, k_batch)
  n_batch, n_x_free = len(x_batch), len(x_free)
  g_batch = list(range(n_batch))
  g_k_free = list(range(n_batch + n_x_free, n_batch + n_x_free + len(k_free)))
  dot_dims = ((tuple(g_k_free), tuple(k_free)), (tuple(g_batch), tuple(k_batch)))
  position = {}
  for i, a in enumerate(x_batch):
    position[a] = i
  for i, a in enumerate(x_free):
    position[a] = n_batch + i
  k_contract_sorted = sorted(k_contract)
  for xa, ka in zip(x_contract, k_contract):
    position[xa] = n_batch + n_x_free + k_contract_sorted.index(ka)
  return dot_dims, tuple(position[a] for a in range(x_ndim))


def wgrad_dimension_numbers(dims, x_ndim, k_ndim):
  """Dimension numbers of `dot_general(x, g)` giving dkernel, and the permutation to its layout.

  The result is [batch, x contracting (ascending), kernel free] and is permuted
  back to the kernel's layout.
  """
  (x_contract, k_contract), (x_batch, k_batch) = dims
  x_free = _free_axes(x_ndim, x_contract, x_batch)
  k_free = _free_axes(k_ndim, k_contract, k_batch)
  n_batch = len(x_batch)
  g_batch = list(range(n_batch))
  g_x_free = list(range(n_batch, n_batch + len(x_free)))
  dot_dims = ((tuple(x_free), tuple(g_x_free)), (tuple(x_batch), tuple(g_batch)))
  position = {}
  for i, a in enumerate(k_batch):
    position[a] = i
  x_contract_sorted = sorted(x_contract)
  for xa, ka in zip(x_contract, k_contract):
    position[ka] = n_batch + x_contract_sorted.index(xa)
  for i, a in enumerate(k_free):
    position[a] = n_batch + len(x_contract) + i
  return dot_dims, tuple(position[a] for a in range(k_ndim))

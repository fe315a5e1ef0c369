"""The built-in example: one jitted train step of an MLP, in FP8 or its bf16 twin.

The FP8 step runs forward and backward through `fp8jax.value_and_grad` with
`fp8_dense` layers; optax's Adam updates the parameters (never the FP8 state).
Every `fp8_dense` gives three GEMMs (fprop, dgrad, wgrad), except that the
first layer has no dgrad: the gradient with respect to the input batch is not
needed, so XLA removes it.

The bf16 twin is the same step (parameters, optimizer, batch, call signature)
with plain `x @ kernel + bias` layers in bfloat16, the way mixed-precision
training without FP8 runs: float32 master weights cast to bf16 for the GEMMs.
Its `fp8_state` is an empty list that passes through untouched, so both steps
are called, compiled and compared the same way (`fp8jax cost`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from fp8jax.core.meta import init_dot_meta
from fp8jax.core.recipes import DelayedScaling
from fp8jax.ops.dense import fp8_dense
from fp8jax.step.training import value_and_grad

PRECISIONS = ("fp8", "bf16")


def _mlp(params, metas, batch, dense):
  """(loss, new metas) of `x -> dense -> gelu -> ... -> dense` with a mean squared error."""
  h = batch["x"]
  new_metas = []
  for i, (layer, meta) in enumerate(zip(params, metas)):
    h, meta = dense(h, layer["kernel"], layer["bias"], meta)
    new_metas.append(meta)
    if i + 1 < len(params):
      h = jax.nn.gelu(h)
  loss = jnp.mean(jnp.square(h.astype(jnp.float32) - batch["y"].astype(jnp.float32)))
  return loss, new_metas


def mlp_loss(params, fp8_state, batch):
  """Mean squared error of the MLP `x -> fp8_dense -> gelu -> ... -> fp8_dense` on `batch`.

  Args:
    params: list of {"kernel": [K, N], "bias": [N]} per layer.
    fp8_state: list of `DotMeta`, one per layer.
    batch: {"x": [B, S, widths[0]] bf16, "y": [B, S, widths[-1]] bf16}.

  Returns:
    (loss float32[], new fp8_state).
  """
  return _mlp(params, fp8_state, batch, fp8_dense)


def _bf16_dense(x, kernel, bias, meta):
  # The GEMM runs in x's dtype (bf16) on float32 master weights, as in
  # mixed-precision training; promoting x to f32 instead would make the
  # baseline a TF32 GEMM and flatter FP8.
  return x @ kernel.astype(x.dtype) + bias.astype(x.dtype), meta


def bf16_mlp_loss(params, fp8_state, batch):
  """`mlp_loss` with plain bf16 `x @ kernel + bias` layers: the baseline without FP8.

  Args:
    params, batch: as for `mlp_loss`.
    fp8_state: an empty list (there is no FP8 state); returned as it came.

  Returns:
    (loss float32[], fp8_state).
  """
  loss, _ = _mlp(params, [None] * len(params), batch, _bf16_dense)
  return loss, fp8_state


def make_train_step(optimizer: optax.GradientTransformation, precision: str = "fp8") -> Callable:
  """`step(params, opt_state, fp8_state, batch) -> (params, opt_state, fp8_state, loss)`, jitted.

  Args:
    optimizer: the optax optimizer of the parameters.
    precision: "fp8" (`fp8_dense` layers, `fp8jax.value_and_grad`) or "bf16"
      (the twin: plain bf16 layers, `jax.value_and_grad`, fp8_state passed through).

  Returns:
    The jitted step, named `fp8_train_step` or `bf16_train_step`.
  """
  _check_precision(precision)

  def apply(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if precision == "fp8":
    grad_fn = value_and_grad(mlp_loss)

    def fp8_train_step(params, opt_state, fp8_state, batch):
      loss, grads, fp8_state = grad_fn(params, fp8_state, batch)
      params, opt_state = apply(params, opt_state, grads)
      return params, opt_state, fp8_state, loss

    return jax.jit(fp8_train_step)

  grad_fn = jax.value_and_grad(bf16_mlp_loss, has_aux=True)

  def bf16_train_step(params, opt_state, fp8_state, batch):
    (loss, fp8_state), grads = grad_fn(params, fp8_state, batch)
    params, opt_state = apply(params, opt_state, grads)
    return params, opt_state, fp8_state, loss

  return jax.jit(bf16_train_step)


def example_train_step(widths: Sequence[int] = (512, 1024, 1024, 512), batch_size: int = 8,
                       seq_len: int = 256, recipe=None,
                       precision: str = "fp8") -> tuple[Callable, tuple]:
  """The example train step and argument specs (shapes and dtypes only) to compile it with.

  Args:
    widths: feature sizes; layer i maps widths[i] -> widths[i + 1].
    batch_size, seq_len: the leading dims of the [B, S, features] batch.
    recipe: the FP8 recipe (default `fp8jax.DelayedScaling()`); only for precision="fp8".
    precision: "fp8" (the default) or "bf16", its twin with the same parameters,
      optimizer and batch, and an empty `fp8_state`.

  Returns:
    (train_step, (params, opt_state, fp8_state, batch)) with `jax.ShapeDtypeStruct` leaves;
    params are float32, the batch bfloat16.
  """
  _check_precision(precision)
  widths = tuple(widths)
  if len(widths) < 2 or not all(_positive_int(w) for w in widths):
    raise ValueError(f"widths={widths!r} must be two or more positive integers "
                     "(layer i maps widths[i] -> widths[i + 1]).")
  for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
    if not _positive_int(value):
      raise ValueError(f"{name}={value!r} must be a positive integer.")
  if precision == "bf16" and recipe is not None:
    raise ValueError(f"recipe={recipe!r} applies to precision='fp8' only; the bf16 twin has "
                     "no FP8 state. Drop the recipe or pass precision='fp8'.")
  recipe = recipe if recipe is not None else DelayedScaling()
  optimizer = optax.adam(1e-3)

  def init():
    keys = jax.random.split(jax.random.key(0), len(widths) - 1)
    params = [{"kernel": jax.random.normal(k, (n_in, n_out), jnp.float32) / n_in**0.5,
               "bias": jnp.zeros((n_out,), jnp.float32)}
              for k, n_in, n_out in zip(keys, widths[:-1], widths[1:])]
    fp8_state = [init_dot_meta(recipe) for _ in params] if precision == "fp8" else []
    batch = {"x": jnp.zeros((batch_size, seq_len, widths[0]), jnp.bfloat16),
             "y": jnp.zeros((batch_size, seq_len, widths[-1]), jnp.bfloat16)}
    return params, optimizer.init(params), fp8_state, batch

  return make_train_step(optimizer, precision), jax.eval_shape(init)


def _check_precision(precision) -> None:
  if precision not in PRECISIONS:
    raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}.")


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def on_mesh(example_args: tuple, mesh, fsdp: bool = False) -> tuple:
  """`example_train_step`'s argument specs placed on `mesh` for a data-parallel step.

  The batch is split over the mesh's first axis; params, optimizer state and
  FP8 state are replicated, or, with `fsdp=True`, every 2-D parameter (and its
  optimizer moments) is split on its rows over that axis too.
  """
  from jax.sharding import NamedSharding, PartitionSpec

  data = mesh.axis_names[0]

  def place(spec, partition):
    return jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                                sharding=NamedSharding(mesh, partition))

  def param_like(spec):
    rows_split = fsdp and spec.ndim == 2 and spec.shape[0] % mesh.shape[data] == 0
    return place(spec, PartitionSpec(data, None) if rows_split else PartitionSpec())

  params, opt_state, fp8_state, batch = example_args
  return (jax.tree.map(param_like, params), jax.tree.map(param_like, opt_state),
          jax.tree.map(lambda s: place(s, PartitionSpec()), fp8_state),
          jax.tree.map(lambda s: place(s, PartitionSpec(data)), batch))

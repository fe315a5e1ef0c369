"""The demo GPT's mixture-of-experts option: each block's MLP as a dropless MoE layer.

    config = gpt.config_for("tiny", experts=4, top_k=2)     # experts=0: the dense MLP
    model = gpt.Gpt(config, recipe=fp8jax.DelayedScaling())
    logits, state = model.apply(variables, tokens, mutable=["fp8_meta", "intermediates"])
    loss = lm_loss + config.aux_loss_weight * load_balancing_loss(state["intermediates"])

With `GptConfig.experts = E > 0` the block's MLP, `down(gelu(up(h)))`, becomes
`fp8jax.flax.linen_moe.Fp8MoE` under the same name ("mlp"): a float32 router picks each
token's `top_k` experts, every expert is an MLP as wide as the dense one (d_ff, Mixtral's
choice: E times the MLP's parameters, top_k times its FLOPs per token), and nothing is
dropped. With a recipe the two grouped GEMMs of each layer (`w_in`, `w_out`) run in FP8
through `fp8jax.fp8_ragged_dot`, each with a `RaggedDotMeta` whose weight scale and
history have one entry per expert; without one (bf16) the same layer runs
`fp8jax.bf16_ragged_dot` in bf16, under the same parameter names and shapes: on an H100
JAX's own Mosaic GPU grouped GEMMs (the best bf16 grouped GEMMs JAX has for Hopper, not
XLA's expansion of `lax.ragged_dot` over every expert), elsewhere `lax.ragged_dot`.

Parameters of a block's MoE MLP (leading n_layers axis under `nn.scan`):

    mlp/router/kernel  [d_model, E]          float32, the router (stays high precision)
    mlp/w_in           [E, d_model, d_ff]    each expert's up projection
    mlp/w_out          [E, d_ff, d_model]    each expert's down projection

and its FP8 state `mlp/w_in_meta`, `mlp/w_out_meta` (`RaggedDotMeta`, kernel scale [E]).
Initialization follows the dense GPT: router and `w_in` normal(0, init_std), `w_out`
normal(0, init_std / sqrt(2 n_layers)).

The training objective. Each MoE layer sows the Switch Transformer load-balancing loss
(1 when the experts' loads and router probabilities are uniform) into "intermediates";
the demo adds `aux_loss_weight` (0.01, Switch's value) times their sum over the layers to
the cross-entropy it differentiates (as Switch and Megatron-LM add each layer's). The
loss it reports, logs and compares is the cross-entropy alone, so an MoE run's loss is
comparable with a dense run's and across recipes; the auxiliary loss is logged beside it
(`aux_loss`, the sum over layers: n_layers when perfectly balanced).
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax

from fp8jax.core.recipes import DelayedScaling, Recipe
from fp8jax.flax.linen_moe import LOSS_NAME, Fp8MoE, sum_sown_losses
from fp8jax.ops.gelu import gelu

#: The collection the MoE layers sow their load-balancing losses into (Flax's own name).
AUX_COLLECTION = "intermediates"


def check_fields(experts, top_k, aux_loss_weight, owner: str = "GptConfig.") -> None:
  """Raises ValueError naming the field for MoE settings a model cannot take.

  Args:
    experts: 0 (the dense MLP) or the number of experts E >= 1.
    top_k: experts per token, 1 <= top_k <= E (unused when experts is 0, but an int >= 1).
    aux_loss_weight: the load-balancing loss's weight, a finite number >= 0.
    owner: what the message calls the fields' holder (e.g. "GptConfig.").

  Returns:
    None; a bad field raises.
  """
  if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
    raise ValueError(f"{owner}experts={experts!r}: expected an int >= 0 (0 keeps the dense "
                     "MLP; E >= 1 makes each block's MLP a mixture of E experts).")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
    raise ValueError(f"{owner}top_k={top_k!r}: expected an int >= 1 (the experts each "
                     "token is routed to).")
  if experts and top_k > experts:
    raise ValueError(f"{owner}top_k={top_k} is more than experts={experts}: each token goes "
                     f"to top_k distinct experts; choose top_k <= {experts} or more experts.")
  if (isinstance(aux_loss_weight, bool) or not isinstance(aux_loss_weight, (int, float))
      or not 0 <= aux_loss_weight < float("inf")):
    raise ValueError(f"{owner}aux_loss_weight={aux_loss_weight!r}: expected a finite number "
                     ">= 0 (0.01 is Switch Transformer's).")


def moe_mlp(config: Any, recipe: Recipe | None, *, dtype: Any, param_dtype: Any,
            output_std: float, name: str) -> Fp8MoE:
  """The MoE layer that replaces a block's MLP (see the module docstring).

  Args:
    config: the model's `GptConfig` (experts, top_k, d_ff, init_std, fp8_saved).
    recipe: the FP8 recipe of the expert GEMMs, or None for bf16 (`fp8jax.bf16_ragged_dot`).
    dtype, param_dtype: the activations' and the parameters' dtypes.
    output_std: the standard deviation of `w_out`'s initializer (the residual branch's).
    name: the layer's name (the dense MLP's, "mlp").

  Returns:
    An unbound `Fp8MoE`: `[batch, seq, d_model] -> [batch, seq, d_model]` in `dtype`.
  """
  # With FP8 saved activations the GELU between the expert GEMMs keeps its input in FP8,
  # as the dense MLP's does.
  activation = functools.partial(gelu, save_fp8=True) if config.fp8_saved else nn.gelu
  return Fp8MoE(num_experts=config.experts, top_k=config.top_k, hidden=config.d_ff,
                activation=activation, fp8=recipe is not None,
                recipe=recipe if recipe is not None else DelayedScaling(), dtype=dtype,
                param_dtype=param_dtype, kernel_init=nn.initializers.normal(config.init_std),
                output_kernel_init=nn.initializers.normal(output_std), name=name)


def mlp_parameters(config: Any) -> int:
  """Parameters of one block's MLP.

  Returns:
    2 d d_ff for the dense MLP; E (2 d d_ff) + d E (the router) with E experts.
  """
  dense = 2 * config.d_model * config.d_ff
  if not config.experts:
    return dense
  return config.experts * dense + config.d_model * config.experts


def load_balancing_loss(collections: Any) -> jax.Array:
  """The sum over the MoE layers of the load-balancing losses they sowed.

  Args:
    collections: what `Gpt.apply(..., mutable=[..., "intermediates"])` returned beside
      the logits (the "intermediates" collection is read; anything else is ignored).

  Returns:
    float32[]: the sum (0 for a dense model).
  """
  return sum_sown_losses(collections.get(AUX_COLLECTION, {}), LOSS_NAME)

"""Any linen model in FP8 through `Fp8Model`: dots a module calls itself, nested applies, rules.

The models below are minimal versions of the patterns of HuggingFace's Flax
models, written without fp8jax: a tied output projection run as a nested
`Dense.apply` on the embedding's transpose (BERT, GPT-2, OPT), a layer calling
`lax.dot_general` itself (GPT-2's Conv1D), attention as plain `jnp.einsum`, and
blocks under `nn.scan`, `nn.remat` and with `nn.Dropout`. References: the same
model without fp8jax (parameters, bf16 training), numpy (recorded amaxes) and
fp8jax's own functions.
"""
import collections
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import fp8jax
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.flax import Fp8Model, Fp8Rule

VOCAB, WIDTH, HEADS, SEQ, BATCH = 64, 32, 2, 16, 2
ALL = (Fp8Rule(),)  # every candidate dot in FP8 (delayed scaling)


class Conv1D(nn.Module):
  """GPT-2's projection: a kernel [out, in] applied with lax.dot_general."""

  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(0.02), (self.features, x.shape[-1]))
    y = lax.dot_general(x, kernel.T, (((x.ndim - 1,), (0,)), ((), ())))
    return y + self.param("bias", nn.initializers.zeros, (self.features,))


class EinsumAttention(nn.Module):
  """Attention whose two products are jnp.einsum calls."""

  @nn.compact
  def __call__(self, x):
    qkv = Conv1D(3 * WIDTH, name="qkv")(x)
    q, k, v = (t.reshape(x.shape[:2] + (HEADS, WIDTH // HEADS)) for t in jnp.split(qkv, 3, -1))
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(WIDTH // HEADS))
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
    return Conv1D(WIDTH, name="out")(out)


class Block(nn.Module):
  dropout: float = 0.0
  deterministic: bool = True

  @nn.compact
  def __call__(self, x):
    x = x + EinsumAttention(name="attn")(nn.LayerNorm()(x))
    h = nn.gelu(Conv1D(2 * WIDTH, name="up")(nn.LayerNorm()(x)))
    h = nn.Dropout(self.dropout, deterministic=self.deterministic)(h)
    return x + Conv1D(WIDTH, name="down")(h)


class TiedHead(nn.Module):
  """BERT's LM head: the decoder Dense applied to the embedding's transpose."""

  vocab: int = VOCAB

  def setup(self):
    self.decoder = nn.Dense(self.vocab, use_bias=False)

  def __call__(self, h, embedding):
    return self.decoder.apply({"params": {"kernel": embedding.T}}, h)


class LanguageModel(nn.Module):
  """Embedding, `layers` blocks (plain, scanned or rematerialized), tied head."""

  layers: int = 2
  blocks: str = "plain"  # "plain", "scan", "scan_without_fp8_axes", "remat"
  dropout: float = 0.0

  @nn.compact
  def __call__(self, ids, train: bool = False):
    embed = nn.Embed(VOCAB, WIDTH)
    x = embed(ids)
    if self.blocks.startswith("scan"):
      axes = {"params": 0} if self.blocks == "scan_without_fp8_axes" else {"params": 0,
                                                                           "fp8_meta": 0}
      body = lambda module, x, _: (module(x), None)
      scanned = nn.scan(body, variable_axes=axes, split_rngs={"params": True},
                        length=self.layers)
      x, _ = scanned(Block(name="blocks"), x, None)
    else:
      block = nn.remat(Block) if self.blocks == "remat" else Block
      for i in range(self.layers):
        x = block(self.dropout, not train, name=f"block_{i}")(x)
    return TiedHead(name="lm_head")(nn.LayerNorm()(x), embed.embedding)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _ids(seed, batch=BATCH):
  return jax.random.randint(jax.random.key(seed), (batch, SEQ), 0, VOCAB)


def _rows(report):
  return {("/".join(map(str, row.path)), row.kind): row for row in report.rows}


def _next_token_loss(logits, ids):
  labels = jnp.roll(ids, -1, axis=1)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         labels).mean()


def _train(model, fp8_model, steps, dropout=False):
  """Trains on one fixed batch; returns the losses and the final (params, fp8_state)."""
  ids = _ids(0)
  optimizer = optax.adam(3e-3)
  if fp8_model is None:
    params = model.init(jax.random.key(1), ids)["params"]
    fp8_state = {}

    def step(params, fp8_state, opt_state, rng):
      loss, grads = jax.value_and_grad(
          lambda p: _next_token_loss(model.apply({"params": p}, ids, train=dropout,
                                                 rngs={"dropout": rng} if dropout else {}),
                                     ids))(params)
      return loss, grads, fp8_state
  else:
    variables = fp8_model.init(jax.random.key(1), ids)
    params, fp8_state = variables["params"], variables["fp8_meta"]

    def step(params, fp8_state, opt_state, rng):
      def loss_fn(params, fp8_state):
        logits, updates = fp8_model.apply(
            {"params": params, "fp8_meta": fp8_state}, ids, train=dropout,
            rngs={"dropout": rng} if dropout else {}, mutable=["fp8_meta"])
        return _next_token_loss(logits, ids), updates["fp8_meta"]
      return fp8jax.value_and_grad(loss_fn)(params, fp8_state)

  @jax.jit
  def train_step(params, fp8_state, opt_state, rng):
    loss, grads, fp8_state = step(params, fp8_state, opt_state, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), fp8_state, opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for i in range(steps):
    params, fp8_state, opt_state, loss = train_step(params, fp8_state, opt_state,
                                                    jax.random.fold_in(jax.random.key(3), i))
    losses.append(float(loss))
  return losses, params, fp8_state


PATTERNS = {
    "nested_apply_conv1d_einsum": dict(blocks="plain"),
    "scanned_blocks": dict(blocks="scan"),
    "remat_blocks": dict(blocks="remat"),
    "dropout": dict(blocks="plain", dropout=0.1),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_each_pattern_trains_20_steps_in_fp8_next_to_bf16_with_the_params_tree_unchanged(pattern):
  model = LanguageModel(**PATTERNS[pattern])
  fp8_model = Fp8Model(model, rules=ALL)
  ids = _ids(0)
  plain = model.init(jax.random.key(1), ids)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every dot converts: no "stays in high precision"
    variables = fp8_model.init(jax.random.key(1), ids)
  assert_trees_equal(variables["params"], plain["params"])

  report = fp8_model.report(jax.random.key(1), ids)
  # Per block: qkv, 2 attention einsums, out, up, down; and the tied head.
  assert len(report.converted) == len(report.rows) == (7 if "scan" in pattern else 13)

  dropout = PATTERNS[pattern].get("dropout", 0.0) > 0
  bf16_losses, _, _ = _train(model, None, 20, dropout)
  fp8_losses, _, fp8_state = _train(model, fp8_model, 20, dropout)
  # Both learn the batch (cross-entropy starts at about log(64) = 4.16)...
  assert fp8_losses[-1] < 0.75 * fp8_losses[0] and bf16_losses[-1] < 0.75 * bf16_losses[0]
  # ...and FP8 follows bf16: E4M3 rounds each operand to 2^-4 relative, the per-step
  # difference this makes averages out over the GEMMs' long sums; after 20 steps the
  # two runs differ by 1-3% (measured); 8% leaves room without hiding a broken GEMM
  # (one without its descale is off by orders of magnitude).
  np.testing.assert_allclose(fp8_losses[-1], bf16_losses[-1], rtol=0.08)
  # Every dot recorded amaxes in training (the init pass records none).
  for meta in jax.tree.leaves(fp8_state, is_leaf=lambda v: isinstance(v, fp8jax.DotMeta)):
    assert np.all(np.asarray(meta.x.amax_history)[..., 0] > 0)


def test_the_nested_apply_keeps_its_state_in_the_module_that_calls_apply():
  ids = _ids(0)
  for fp8_model in (Fp8Model(LanguageModel(), rules=ALL),
                    Fp8Model(LanguageModel(), layer_filter=lambda layer: True)):
    variables = fp8_model.init(jax.random.key(1), ids)
    meta = variables["fp8_meta"]["lm_head"]["decoder_apply"]["dot_meta"]
    assert_trees_equal(meta, fp8jax.init_dot_meta(fp8jax.DelayedScaling()))
    losses, params, fp8_state = _train(LanguageModel(), fp8_model, 2)
    assert np.isfinite(losses).all()
    kernel_amax = fp8_state["lm_head"]["decoder_apply"]["dot_meta"].kernel.amax_history[0]
    # The head's kernel is the embedding's transpose: its amax is the embedding's (as
    # trained by the first step, which the second step's forward reads).
    assert kernel_amax > 0


def test_the_nested_apply_model_trains_under_the_default_filter_at_a_size_it_converts():
  class WideTied(nn.Module):
    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(2048, 1536)  # K=1536, N=2048: predicted 1.2x at 4096 tokens
      return TiedHead(2048, name="lm_head")(embed(ids), embed.embedding)

  ids = jax.random.randint(jax.random.key(0), (1, 16), 0, 2048)
  fp8_model = Fp8Model(WideTied())
  variables = fp8_model.init(jax.random.key(1), ids)
  assert set(variables["fp8_meta"]["lm_head"]) == {"decoder_apply"}

  def loss_fn(params, fp8_state):
    logits, updates = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, ids,
                                      mutable=["fp8_meta"])
    return _next_token_loss(logits, ids), updates["fp8_meta"]

  _, grads, fp8_state = jax.jit(fp8jax.value_and_grad(loss_fn))(variables["params"],
                                                                 variables["fp8_meta"])
  embedding = np.asarray(variables["params"]["Embed_0"]["embedding"], np.float64)
  recorded = fp8_state["lm_head"]["decoder_apply"]["dot_meta"].kernel.amax_history[0]
  assert recorded == np.abs(embedding).max()  # the kernel is embedding.T: same amax
  assert np.all(np.isfinite(np.asarray(grads["Embed_0"]["embedding"])))


def test_scan_that_does_not_carry_the_fp8_state_warns_and_stays_in_high_precision():
  model = LanguageModel(blocks="scan_without_fp8_axes")
  fp8_model = Fp8Model(model, rules=ALL)
  ids = _ids(0)
  with pytest.warns(UserWarning, match=r"blocks.*stays in high precision.*variable_axes"):
    variables = fp8_model.init(jax.random.key(1), ids)
  assert set(variables["fp8_meta"]) == {"lm_head"}
  report = _rows(fp8_model.report(jax.random.key(1), ids))
  assert not report[("blocks/up/dot_general_0", "dot_general")].fp8
  assert report[("lm_head/decoder_apply", "Dense")].fp8
  # Outside the scan FP8 runs as usual, and the model trains.
  losses, _, _ = _train(model, fp8_model, 3)
  assert np.isfinite(losses).all()


def test_a_dot_that_a_module_calls_itself_computes_what_fp8_dot_general_computes():
  x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, WIDTH), jnp.float32)
  fp8_model = Fp8Model(Conv1D(48), rules=ALL)
  variables = fp8_model.init(jax.random.key(1), x)
  out, updates = fp8_model.apply(variables, x, mutable=["fp8_meta"])
  params = variables["params"]
  expected, expected_meta = fp8jax.fp8_dot_general(
      x, params["kernel"].T, variables["fp8_meta"]["dot_general_0"],
      (((2,), (0,)), ((), ())))
  np.testing.assert_array_equal(out, expected + params["bias"])
  assert_trees_equal(updates["fp8_meta"]["dot_general_0"], expected_meta)
  # And against float64 numpy: E4M3 keeps 3 mantissa bits, so each operand element is
  # off by up to 2^-4 relative (rms 2^-4 / sqrt(3), 3.6%); with the two operands' errors
  # independent the output's norm-relative error is about sqrt(2) x 3.6% = 5% (measured
  # 4.2%). 8% passes FP8 rounding and fails a missing descale or a transposed kernel.
  want = (np.asarray(x, np.float64) @ np.asarray(params["kernel"], np.float64).T
          + np.asarray(params["bias"], np.float64))
  assert np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want) < 0.08


def test_two_rules_give_two_recipes_to_two_parts_of_one_model():
  rules = (Fp8Rule(path=r".*attn.*", recipe=fp8jax.CurrentScaling()),
           Fp8Rule(path=r".*block_.*", recipe=fp8jax.BlockScaling()),
           Fp8Rule(path="lm_head.*", recipe=None))
  fp8_model = Fp8Model(LanguageModel(), rules=rules)
  ids = _ids(0)
  variables = fp8_model.init(jax.random.key(1), ids)
  state = variables["fp8_meta"]
  for i in range(2):
    block = state[f"block_{i}"]
    assert block["attn"]["einsum_1"].recipe == fp8jax.CurrentScaling()
    assert block["attn"]["qkv"]["dot_general_0"].recipe == fp8jax.CurrentScaling()
    assert block["up"]["dot_general_0"].recipe == fp8jax.BlockScaling()
  assert "lm_head" not in state
  report = _rows(fp8_model.report(jax.random.key(1), ids))
  assert report[("block_0/up/dot_general_0", "dot_general")].recipe == "BlockScaling"
  assert report[("lm_head/decoder_apply", "Dense")].reason.startswith("rules[2]")
  losses, _, _ = _train(LanguageModel(), fp8_model, 3)
  assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_state_names_survive_retracing_and_a_checkpoint_round_trip(tmp_path):
  import fp8jax.checkpoint as ckpt  # the test extra installs orbax
  model = LanguageModel()
  fp8_model = Fp8Model(model, rules=ALL)
  _, params, fp8_state = _train(model, fp8_model, 2)
  # Another batch size retraces the model; the state keeps its names and structure.
  ids = _ids(5, batch=3)
  _, updates = jax.jit(lambda p, s: fp8_model.apply({"params": p, "fp8_meta": s}, ids,
                                                    mutable=["fp8_meta"]))(params, fp8_state)
  assert jax.tree.structure(updates["fp8_meta"]) == jax.tree.structure(fp8_state)
  path = ckpt.save(tmp_path / "step_2", params=params, opt_state={}, fp8_state=fp8_state)
  restored = ckpt.restore(path, params=params, opt_state={}, fp8_state=fp8_state)
  assert_trees_equal(restored["fp8_state"], fp8_state)


def test_the_report_lists_every_dot_of_a_two_layer_transformer_with_its_reason():
  ids = _ids(0)
  fp8_model = Fp8Model(LanguageModel(), rules=(Fp8Rule(op="einsum", recipe=None),))
  report = fp8_model.report(jax.random.key(1), ids)
  expected = []
  for i in range(2):
    expected += [(f"block_{i}/attn/qkv/dot_general_0", "dot_general"),
                 (f"block_{i}/attn/einsum_0", "einsum"), (f"block_{i}/attn/einsum_1", "einsum"),
                 (f"block_{i}/attn/out/dot_general_0", "dot_general"),
                 (f"block_{i}/up/dot_general_0", "dot_general"),
                 (f"block_{i}/down/dot_general_0", "dot_general")]
  expected.append(("lm_head/decoder_apply", "Dense"))
  assert list(_rows(report)) == expected
  for (path, kind), row in _rows(report).items():
    assert not row.fp8
    if kind == "einsum":
      assert row.reason == "rules[0] (path='.*', op='einsum'): high precision"
    else:  # K = 32 or 64: far below the break-even size
      assert row.reason.startswith("default_layer_filter: not chosen (K=")
  text = str(report)
  assert "block_1/attn/einsum_1" in text and "0 of 13 dots run in FP8." in text
  assert '"total": 13' in report.to_json()


def test_init_warns_when_no_dot_is_converted():
  with pytest.warns(UserWarning, match="runs none of the model's 13 candidate dots in FP8") as seen:
    Fp8Model(LanguageModel()).init(jax.random.key(1), _ids(0))
  message = str(seen[0].message)
  assert "or pass a layer_filter" in message
  assert "go by rules only (a layer_filter does not decide them)" in message


def test_no_dot_converted_with_a_layer_filter_says_the_filter_chose_none():
  """A passed filter that chose nothing cannot be fixed by passing a filter: say so, and
  that the dots modules call themselves never go by a filter."""
  model = Fp8Model(LanguageModel(), layer_filter=lambda layer: False)
  with pytest.warns(UserWarning, match="runs none of the model's 13 candidate dots") as seen:
    model.init(jax.random.key(1), _ids(0))
  message = str(seen[0].message)
  assert "the layer_filter you passed chose none of the" in message
  assert "or pass a layer_filter" not in message
  assert "go by rules only" in message


def test_rules_are_checked_with_errors_that_name_the_rule():
  with pytest.raises(TypeError, match="tuple of fp8jax.flax.Fp8Rule"):
    Fp8Model(LanguageModel(), rules=Fp8Rule())
  with pytest.raises(ValueError, match=r"rules\[0\].path='\(' is not a regular expression"):
    Fp8Model(LanguageModel(), rules=(Fp8Rule(path="("),))
  with pytest.raises(TypeError, match=r"rules\[1\] must be an fp8jax.flax.Fp8Rule"):
    Fp8Model(LanguageModel(), rules=(Fp8Rule(), "attn"))


_MISSING = deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_on_h100_every_converted_dot_is_three_fp8_cublaslt_gemms(pattern):
  model = LanguageModel(**PATTERNS[pattern])
  fp8_model = Fp8Model(model, rules=ALL)
  ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
  variables = jax.eval_shape(fp8_model.init, jax.random.key(1), ids)
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16),
                        variables["params"])

  train = PATTERNS[pattern].get("dropout", 0.0) > 0

  def step(params, fp8_state, ids):
    def loss_fn(params, fp8_state):
      logits, updates = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, ids,
                                        train=train, rngs={"dropout": jax.random.key(0)},
                                        mutable=["fp8_meta"])
      return _next_token_loss(logits, ids), updates["fp8_meta"]
    return fp8jax.value_and_grad(loss_fn)(params, fp8_state)

  report = fp8jax.lowering.inspect(step, params, variables["fp8_meta"], ids,
                                   target="deviceless", ptx=False,
                                   compiler_options=fp8jax.lowering.CUBLAS_ONLY_OPTIONS)
  converted = len(fp8_model.report(jax.random.key(1), ids).converted)
  # fprop, dgrad and wgrad of every dot: the first block's input comes from the
  # embedding, a parameter, so every dot's input gradient is needed too. Under
  # nn.scan the body's GEMMs appear once in the program; under nn.remat the backward
  # pass recomputes the blocks' forward GEMMs (each block's last, "down", is not needed).
  roles = collections.Counter(gemm.role for gemm in report.gemms)
  recomputed = 2 * 5 if pattern == "remat_blocks" else 0
  assert roles == {"fprop": converted + recomputed, "dgrad": converted, "wgrad": converted}, \
      str(report)
  assert not report.not_fp8(), str(report)


# ----- the calls read as dot_general, and the places FP8 cannot go -----------------------


@pytest.mark.parametrize("kind, args, kwargs", [
    ("einsum", ("bqhd,bkhd->bhqk", (2, 8, 3, 16), (2, 4, 3, 16)), {}),
    ("einsum", ("...d,ed", (2, 3, 16), (4, 16)), {}),  # implicit output, ellipsis
    ("einsum", ("ij,jk", (8, 16), (16, 4)), {"preferred_element_type": jnp.float32}),
    ("einsum", ("hbk,bhk->bh", (3, 2, 16), (2, 3, 16)), {}),  # batch dims out of order
    ("matmul", ((2, 8, 16), (16, 4)), {}),
    ("matmul", ((3, 8, 16), (3, 16, 4)), {}),
    ("dot", ((2, 8, 16), (16, 4)), {}),
    ("dot_general", ((2, 8, 16), (8, 4, 16), (((2,), (2,)), ((1,), (0,)))), {}),
])
def test_each_call_read_as_dot_general_gives_what_jax_gives(kind, args, kwargs):
  from fp8jax.flax.dot_calls import read_dot_call
  # Small integers in float32: every product and sum is exact, so any two correct
  # computations agree bit for bit whatever their summation order.
  arrays = [jnp.round(4 * jax.random.normal(jax.random.key(i), a)) if isinstance(a, tuple)
            and all(isinstance(d, int) for d in a) else a for i, a in enumerate(args)]
  if kind == "dot_general":
    arrays = arrays[:2] + [args[2]]
  want = {"einsum": jnp.einsum, "matmul": jnp.matmul, "dot": jnp.dot,
          "dot_general": lax.dot_general}[kind](*arrays, **kwargs)
  call = read_dot_call(kind, tuple(arrays), kwargs)
  assert call is not None and call.blocker is None, call
  got = lax.dot_general(call.lhs, call.rhs, call.dims)
  if call.permutation is not None:
    got = jnp.transpose(got, call.permutation)
  assert got.astype(call.dtype).dtype == want.dtype
  np.testing.assert_array_equal(got, want)


def test_an_einsum_whose_batch_dims_broadcast_stays_in_high_precision():
  class Broadcast(nn.Module):
    @nn.compact
    def __call__(self, x, y):
      return jnp.einsum("bij,bjk->bik", x, y)

  x, y = _normal_array((1, 16, 32), 0), _normal_array((3, 32, 16), 1)
  with pytest.warns(UserWarning, match="einsum.*stays in high precision: its batch dims"):
    variables = Fp8Model(Broadcast(), rules=ALL).init(jax.random.key(0), x, y)
  np.testing.assert_array_equal(Fp8Model(Broadcast(), rules=ALL).apply(variables, x, y),
                                jnp.einsum("bij,bjk->bik", x, y))


def test_flax_multi_head_attention_runs_its_attention_products_in_fp8():
  attention = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)
  x = _normal_array((BATCH, SEQ, WIDTH), 0)
  fp8_model = Fp8Model(attention, rules=ALL)
  variables = fp8_model.init(jax.random.key(1), x)
  rows = _rows(fp8_model.report(jax.random.key(1), x))
  # q, k, v and out are DenseGeneral layers; the two products are dot_product_attention's
  # einsums, which Flax calls with lax.dot_general as their _dot_general.
  assert {kind for (_, kind), row in rows.items() if row.fp8} == {"DenseGeneral", "einsum"}
  assert len(rows) == 6 and all(row.fp8 for row in rows.values()), rows
  assert set(variables["fp8_meta"]) == {"query", "key", "value", "out", "einsum_0", "einsum_1"}

  def loss_fn(params, fp8_state):
    out, updates = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                   mutable=["fp8_meta"])
    return jnp.mean(out ** 2), updates["fp8_meta"]

  _, _, state = jax.jit(fp8jax.value_and_grad(loss_fn))(variables["params"],
                                                         variables["fp8_meta"])
  assert float(state["einsum_1"].x.amax_history[0]) > 0  # the softmax weights, recorded


@pytest.mark.parametrize("transform", ["checkpoint", "scan"])
def test_a_dot_inside_a_raw_jax_transform_stays_in_high_precision_with_a_warning(transform):
  class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
      kernel = self.param("kernel", nn.initializers.normal(0.1), (WIDTH, WIDTH))
      if transform == "checkpoint":
        return jax.checkpoint(lambda x: jnp.matmul(x, kernel))(x)
      return lax.scan(lambda c, _: (jnp.matmul(c, kernel), None), x, None, length=2)[0]

  x = _normal_array((BATCH, WIDTH), 0)
  fp8_model = Fp8Model(Inner(), rules=ALL)
  with pytest.warns(UserWarning, match="matmul.*inside a JAX transform.*nn.remat, nn.scan"):
    variables = fp8_model.init(jax.random.key(1), x)
  assert "fp8_meta" not in variables
  out = fp8_model.apply(variables, x)
  np.testing.assert_array_equal(out, Inner().apply(variables, x))


def test_apply_without_the_state_of_rematerialized_blocks_says_to_pass_it():
  fp8_model = Fp8Model(LanguageModel(blocks="remat"), rules=ALL)
  params = fp8_model.init(jax.random.key(1), _ids(0))["params"]
  with pytest.raises(ValueError, match="no 'fp8_meta' state for it. Pass the 'fp8_meta'"):
    fp8_model.apply({"params": params}, _ids(0))


def test_a_module_sharing_the_roots_scope_keeps_its_state_at_its_own_path():
  class Shared(nn.Module):
    def setup(self):
      self.inner = Conv1D(WIDTH)
      nn.share_scope(self, self.inner)

    def __call__(self, x):
      return self.inner(x)

  x = _normal_array((BATCH, WIDTH), 0)
  variables = Fp8Model(Shared(), rules=ALL).init(jax.random.key(1), x)
  assert set(variables["params"]) == {"kernel", "bias"}
  assert set(variables["fp8_meta"]) == {"dot_general_0"}


def _normal_array(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)

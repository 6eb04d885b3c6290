"""Random training models for the fuzzer (the corpus as a fuzzer).

The hand-written corpus (models.py) covers each op family memopt handles once; this
module draws many small models that mix them. A model is first a *description*: a
frozen `ModelSpec` holding a tuple of frozen layer specs (`Linear`, `Conv`,
`BatchNorm`, `Residual`, `Tap`, ...) and the output heads. Descriptions are plain
data: hypothesis draws and shrinks them, their repr is valid Python (a failing
example pastes straight into a reproducer), and `build_model(spec)` /
`make_inputs(spec)` turn one into an nn.Module and its example inputs.

The families drawn: Linear, Conv2d, BatchNorm (train mode, 1d and 2d), LayerNorm,
Dropout (also in place), activations (out of place and in place: ReLU(inplace=True),
leaky_relu_, tanh_, sigmoid_), scalar in-place ops (x.add_(c), x.mul_(c)), in-place
ops through a slice view, residual branches (`out + skip` or `out += skip`), repeated
blocks (depth, each copy with its own parameters), views and
reshapes (regrouping features, transposing H and W, flattening), pooling, several
outputs (a tensor, a tuple or a dict, with heads, the features themselves, a slice of
them, and intermediate tensors tapped on the way), frozen parameters
(requires_grad=False on some layers) and an input that may require grad.

Every description `model_specs()` draws is a valid eager training step, by
construction: while drawing, the strategy tracks the current tensor's shape and
whether it may be written in place (`_State`). Eager PyTorch refuses an in-place op
on a tensor autograd saved for backward (ReLU, Tanh and Sigmoid save their outputs),
on a leaf that requires grad, or on a view of one; outputs that alias the input are
left out too. At least one parameter or the input requires grad, so there is always
a backward to plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

# --------------------------------------------------------------------------
# The description: one frozen dataclass per layer kind
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """nn.Linear on the last dimension."""

    width: int
    bias: bool = True
    frozen: bool = False


@dataclass(frozen=True)
class Conv:
    """nn.Conv2d(C, width, kernel, stride, padding=kernel // 2)."""

    width: int
    kernel: int = 1
    stride: int = 1
    bias: bool = True
    frozen: bool = False


@dataclass(frozen=True)
class BatchNorm:
    """BatchNorm1d on (B, F), BatchNorm2d on (B, C, H, W); the model trains, so the step
    uses batch statistics and updates the running ones."""

    frozen: bool = False


@dataclass(frozen=True)
class LayerNorm:
    """nn.LayerNorm over the last dimension."""

    frozen: bool = False


@dataclass(frozen=True)
class Dropout:
    """F.dropout(x, p, training=True, inplace=inplace)."""

    p: float = 0.1
    inplace: bool = False


#: Out-of-place activations, and whether autograd saves their output (then the output
#: may not be written in place afterwards).
ACTIVATIONS = {"relu": True, "gelu": False, "tanh": True, "silu": False, "sigmoid": True,
               "leaky_relu": False}

#: In-place activations; every one saves its result for backward.
INPLACE_ACTIVATIONS = ("relu_module", "relu_", "leaky_relu_", "tanh_", "sigmoid_")


@dataclass(frozen=True)
class Act:
    name: str = "relu"  # a key of ACTIVATIONS


@dataclass(frozen=True)
class InplaceAct:
    """nn.ReLU(inplace=True) ("relu_module"), F.leaky_relu_ or a tensor method."""

    name: str = "relu_module"  # one of INPLACE_ACTIVATIONS


@dataclass(frozen=True)
class ScalarInplace:
    """x.add_(value) or x.mul_(value)."""

    op: str = "add_"
    value: float = 1.0


@dataclass(frozen=True)
class SliceInplace:
    """x[:, :k].mul_(value): an in-place op through a slice view of dimension 1."""

    k: int = 1
    value: float = 0.5


@dataclass(frozen=True)
class Regroup:
    """(B, F) -> view (B, groups, F // groups) [-> transpose(1, 2)] -> reshape (B, F)."""

    groups: int = 2
    transpose: bool = True


@dataclass(frozen=True)
class TransposeHW:
    """(B, C, H, W) -> (B, C, W, H), a view, optionally made contiguous."""

    contiguous: bool = False


@dataclass(frozen=True)
class Pool:
    """MaxPool2d(2) or AvgPool2d(2)."""

    kind: str = "max"


@dataclass(frozen=True)
class Flatten:
    """(B, C, H, W) -> (B, F): "view" is x.flatten(1), "mean" averages H and W, "max" is
    adaptive_max_pool2d(x, 1).flatten(1)."""

    how: str = "view"


@dataclass(frozen=True)
class Tap:
    """Return the current tensor as an extra output (later layers may still write it in
    place: the output is then the written tensor, as in eager)."""


@dataclass(frozen=True)
class Residual:
    """x + body(x), or body(x) += x when `inplace`; the body keeps the shape and starts
    with a Linear or a Conv."""

    body: tuple[Layer, ...]
    inplace: bool = False


@dataclass(frozen=True)
class Repeat:
    """`times` (2-8) copies of a shape-keeping body in sequence, each with its own
    parameters (the body starts with a Linear or a Conv): depth, so that a budget has
    activations to trade for recomputation."""

    body: tuple[Layer, ...]
    times: int = 2


Layer = (Linear | Conv | BatchNorm | LayerNorm | Dropout | Act | InplaceAct | ScalarInplace
         | SliceInplace | Regroup | TransposeHW | Pool | Flatten | Tap | Residual | Repeat)


@dataclass(frozen=True)
class Head:
    """One output computed from the final tensor: "linear" (nn.Linear on the last
    dimension), "identity" (the tensor itself) or "slice" (the view h[:, :width])."""

    kind: str = "linear"
    width: int = 4
    frozen: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: input shape (batch first), its layers and its outputs.

    `outputs` is "tensor" (one head, no taps), "tuple" or "dict"; the outputs are the
    heads in order, then the tapped tensors in order."""

    input_shape: tuple[int, ...]
    input_grad: bool
    layers: tuple[Layer, ...]
    heads: tuple[Head, ...]
    outputs: str = "tensor"


# --------------------------------------------------------------------------
# Shapes (shared by the strategy and the builder)
# --------------------------------------------------------------------------


def shape_after(layer: Layer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the current tensor after `layer` (batch dimension included)."""
    if isinstance(layer, Linear):
        return (*shape[:-1], layer.width)
    if isinstance(layer, Conv):
        b, _, h, w = shape
        pad = layer.kernel // 2
        out = lambda n: (n + 2 * pad - layer.kernel) // layer.stride + 1
        return (b, layer.width, out(h), out(w))
    if isinstance(layer, TransposeHW):
        return (shape[0], shape[1], shape[3], shape[2])
    if isinstance(layer, Pool):
        return (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
    if isinstance(layer, Flatten):
        return (shape[0], shape[1] * shape[2] * shape[3]) if layer.how == "view" \
            else (shape[0], shape[1])
    return shape


def output_shapes(spec: ModelSpec) -> tuple[tuple[int, ...], ...]:
    """The shape of every output, heads first, then taps."""
    shape, taps = spec.input_shape, []
    for layer in spec.layers:
        if isinstance(layer, Tap):
            taps.append(shape)
        shape = shape_after(layer, shape)
    heads = []
    for head in spec.heads:
        if head.kind == "linear":
            heads.append((*shape[:-1], head.width))
        elif head.kind == "slice":
            heads.append((shape[0], head.width, *shape[2:]))
        else:
            heads.append(shape)
    return (*heads, *taps)


# --------------------------------------------------------------------------
# The builder
# --------------------------------------------------------------------------


def _freeze(module: nn.Module, frozen: bool) -> nn.Module:
    if frozen:
        module.requires_grad_(False)
    return module


_ACTIVATION_FNS = {"relu": torch.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu,
                   "sigmoid": torch.sigmoid}


class _Op(nn.Module):
    """A parameter-free layer (activation, in-place op, view, pooling)."""

    def __init__(self, layer: Layer) -> None:
        super().__init__()
        self.layer = layer
        if isinstance(layer, InplaceAct) and layer.name == "relu_module":
            self.relu = nn.ReLU(inplace=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if isinstance(layer, Act):
            if layer.name == "leaky_relu":
                return F.leaky_relu(h, 0.1)
            return _ACTIVATION_FNS[layer.name](h)
        if isinstance(layer, InplaceAct):
            if layer.name == "relu_module":
                return self.relu(h)
            if layer.name == "leaky_relu_":
                return F.leaky_relu_(h, 0.1)
            return getattr(h, layer.name)()
        if isinstance(layer, ScalarInplace):
            return getattr(h, layer.op)(layer.value)
        if isinstance(layer, SliceInplace):
            h[:, : layer.k].mul_(layer.value)
            return h
        if isinstance(layer, Dropout):
            return F.dropout(h, layer.p, self.training, inplace=layer.inplace)
        if isinstance(layer, Regroup):
            b, f = h.shape
            g = h.view(b, layer.groups, f // layer.groups)
            if layer.transpose:
                g = g.transpose(1, 2)
            return g.reshape(b, f)
        if isinstance(layer, TransposeHW):
            t = h.transpose(2, 3)
            return t.contiguous() if layer.contiguous else t
        if isinstance(layer, Pool):
            return F.max_pool2d(h, 2) if layer.kind == "max" else F.avg_pool2d(h, 2)
        if isinstance(layer, Flatten):
            if layer.how == "view":
                return h.flatten(1)
            if layer.how == "mean":
                return h.mean(dim=(2, 3))
            return F.adaptive_max_pool2d(h, 1).flatten(1)
        raise TypeError(f"not a parameter-free layer: {layer!r}")


class _Residual(nn.Module):
    def __init__(self, body: nn.ModuleList, inplace: bool) -> None:
        super().__init__()
        self.body = body
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for layer in self.body:
            out = layer(out)
        if self.inplace:
            out += x
            return out
        return out + x


class _Repeat(nn.Module):
    def __init__(self, copies: nn.ModuleList) -> None:
        super().__init__()
        self.copies = copies

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for body in self.copies:
            for layer in body:
                h = layer(h)
        return h


class _Tap(nn.Module):
    """A marker: FuzzModel collects the tensor here as an output."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


class _Slice(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, : self.width]


def _build_layers(layers: tuple[Layer, ...], shape: tuple[int, ...]) -> tuple[nn.ModuleList,
                                                                            tuple[int, ...]]:
    modules = nn.ModuleList()
    for layer in layers:
        image = len(shape) == 4
        if isinstance(layer, Linear):
            module = _freeze(nn.Linear(shape[-1], layer.width, bias=layer.bias), layer.frozen)
        elif isinstance(layer, Conv):
            module = _freeze(nn.Conv2d(shape[1], layer.width, layer.kernel, layer.stride,
                                       padding=layer.kernel // 2, bias=layer.bias),
                             layer.frozen)
        elif isinstance(layer, BatchNorm):
            norm = nn.BatchNorm2d(shape[1]) if image else nn.BatchNorm1d(shape[1])
            module = _freeze(norm, layer.frozen)
        elif isinstance(layer, LayerNorm):
            module = _freeze(nn.LayerNorm(shape[-1]), layer.frozen)
        elif isinstance(layer, Residual):
            body, body_shape = _build_layers(layer.body, shape)
            assert body_shape == shape, (layer, shape, body_shape)
            module = _Residual(body, layer.inplace)
        elif isinstance(layer, Repeat):
            module = _Repeat(nn.ModuleList(_build_layers(layer.body, shape)[0]
                                           for _ in range(layer.times)))
        elif isinstance(layer, Tap):
            module = _Tap()
        else:
            module = _Op(layer)
        modules.append(module)
        shape = shape_after(layer, shape)
    return modules, shape


class FuzzModel(nn.Module):
    """The module a ModelSpec describes; `spec` is kept for the reader of a failure."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layers, shape = _build_layers(spec.layers, spec.input_shape)
        self.heads = nn.ModuleList()
        for head in spec.heads:
            if head.kind == "linear":
                self.heads.append(_freeze(nn.Linear(shape[-1], head.width), head.frozen))
            elif head.kind == "slice":
                self.heads.append(_Slice(head.width))
            else:
                self.heads.append(nn.Identity())
        self.outputs = spec.outputs

    def forward(self, x: torch.Tensor):
        taps = []
        h = x
        for layer in self.layers:
            if isinstance(layer, _Tap):
                taps.append(h)
            h = layer(h)
        outs = [head(h) for head in self.heads] + taps
        if self.outputs == "tensor":
            return outs[0]
        if self.outputs == "tuple":
            return tuple(outs)
        return {f"out{i}": out for i, out in enumerate(outs)}


def build_model(spec: ModelSpec) -> FuzzModel:
    """A fresh model in train mode; its weights come from the global RNG (seed first)."""
    return FuzzModel(spec).train()


def make_inputs(spec: ModelSpec) -> tuple[torch.Tensor]:
    """Fresh example inputs from the global RNG (seed first)."""
    return (torch.randn(*spec.input_shape).requires_grad_(spec.input_grad),)


# --------------------------------------------------------------------------
# The strategy
# --------------------------------------------------------------------------

FEATURES = (8, 12, 16, 24, 32, 48, 64)   # flat widths, each with divisors for Regroup
CHANNELS = (4, 8, 16, 24, 32)
SCALARS = (0.5, 2.0, -1.0, 1.5)


@dataclass(frozen=True)
class _State:
    """What the strategy knows about the current tensor while it draws layers."""

    shape: tuple[int, ...]
    fresh: bool      # computed by the model (not the input, nor a view of it)
    mutable: bool    # an in-place op on it (or a view of it) is legal in eager autograd


def _after(layer: Layer, state: _State) -> _State:
    """The state after `layer` (the rules the module docstring states)."""
    shape = shape_after(layer, state.shape)
    if isinstance(layer, Repeat):
        for inner in layer.body:
            state = _after(inner, state)
        return state
    if isinstance(layer, (Linear, Conv, BatchNorm, LayerNorm, Pool, Residual)):
        return _State(shape, True, True)     # a new tensor that its op does not save
    if isinstance(layer, Dropout):
        return _State(shape, True, True if not layer.inplace else state.mutable)
    if isinstance(layer, Act):
        return _State(shape, True, not ACTIVATIONS[layer.name])
    if isinstance(layer, InplaceAct):
        return _State(shape, True, False)    # saves its result
    if isinstance(layer, TransposeHW) and layer.contiguous:
        return _State(shape, True, True)
    if isinstance(layer, Flatten) and layer.how != "view":
        return _State(shape, True, True)
    return _State(shape, state.fresh, state.mutable)   # views, scalar in-place ops, taps


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n // 2 + 1) if n % d == 0]


@st.composite
def _body(draw, state: _State, *, depth: int, extra: int) -> tuple[tuple[Layer, ...], _State]:
    """A shape-keeping body for Residual / Repeat: a Linear or a Conv (so that what the body
    computes is a new tensor, whatever came in), then up to `extra` more layers."""
    frozen = draw(st.booleans())
    if len(state.shape) == 4:
        first: Layer = Conv(state.shape[1], draw(st.sampled_from((1, 3))), 1,
                            draw(st.booleans()), frozen)
    else:
        first = Linear(state.shape[-1], draw(st.booleans()), frozen)
    body = [first]
    state = _after(first, _State(state.shape, False, False))
    for _ in range(draw(st.integers(0, extra))):
        layer = draw(_layer(state, keep_shape=True, depth=depth))
        body.append(layer)
        state = _after(layer, state)
    return tuple(body), state


@st.composite
def _layer(draw, state: _State, *, keep_shape: bool, depth: int) -> Layer:
    """One layer legal in `state`; `keep_shape` (inside a body) keeps the shape. `depth` is 0
    at the top level (every kind), 1 inside a Repeat (a Residual may nest there), 2 inside
    a Residual."""
    image = len(state.shape) == 4
    kinds = ["linear"] if not image else ["conv"]
    kinds += ["batchnorm", "layernorm", "dropout", "act"]
    if state.mutable:
        kinds += ["inplace_act", "scalar_inplace", "slice_inplace", "dropout_inplace"]
    if not image and _divisors(state.shape[-1]):
        kinds.append("regroup")
    if image and (not keep_shape or state.shape[2] == state.shape[3]):
        kinds.append("transpose")
    if image and not keep_shape:
        kinds.append("flatten")
        if min(state.shape[2:]) >= 4:
            kinds.append("pool")
    if depth <= 1:
        kinds.append("residual")
    if depth == 0:
        kinds.append("repeat")
        if state.fresh:
            kinds.append("tap")
    kind = draw(st.sampled_from(kinds))
    frozen = st.booleans()
    if kind == "linear":
        width = state.shape[-1] if keep_shape else draw(st.sampled_from(FEATURES))
        return Linear(width, draw(st.booleans()), draw(frozen))
    if kind == "conv":
        width = state.shape[1] if keep_shape else draw(st.sampled_from(CHANNELS))
        stride = 1 if keep_shape or min(state.shape[2:]) < 4 else draw(st.sampled_from((1, 2)))
        return Conv(width, draw(st.sampled_from((1, 3))), stride, draw(st.booleans()),
                    draw(frozen))
    if kind == "batchnorm":
        return BatchNorm(draw(frozen))
    if kind == "layernorm":
        return LayerNorm(draw(frozen))
    if kind in ("dropout", "dropout_inplace"):
        return Dropout(draw(st.sampled_from((0.1, 0.5))), kind == "dropout_inplace")
    if kind == "act":
        return Act(draw(st.sampled_from(tuple(ACTIVATIONS))))
    if kind == "inplace_act":
        return InplaceAct(draw(st.sampled_from(INPLACE_ACTIVATIONS)))
    if kind == "scalar_inplace":
        return ScalarInplace(draw(st.sampled_from(("add_", "mul_"))), draw(st.sampled_from(SCALARS)))
    if kind == "slice_inplace":
        k = draw(st.integers(1, max(1, state.shape[1] - 1)))
        return SliceInplace(k, draw(st.sampled_from(SCALARS)))
    if kind == "regroup":
        return Regroup(draw(st.sampled_from(_divisors(state.shape[-1]))), draw(st.booleans()))
    if kind == "transpose":
        return TransposeHW(draw(st.booleans()))
    if kind == "flatten":
        return Flatten(draw(st.sampled_from(("view", "mean", "max"))))
    if kind == "pool":
        return Pool(draw(st.sampled_from(("max", "avg"))))
    if kind == "tap":
        return Tap()
    if kind == "repeat":
        body, _ = draw(_body(state, depth=1, extra=3))
        return Repeat(body, draw(st.integers(2, 8)))
    assert kind == "residual", kind
    body, end = draw(_body(state, depth=2, extra=2))
    return Residual(body, draw(st.booleans()) if end.mutable else False)


def _trainable(layers: tuple[Layer, ...]) -> bool:
    for layer in layers:
        if isinstance(layer, (Residual, Repeat)) and _trainable(layer.body):
            return True
        if isinstance(layer, (Linear, Conv, BatchNorm, LayerNorm)) and not layer.frozen:
            return True
    return False


@st.composite
def model_specs(draw, max_layers: int = 12) -> ModelSpec:
    """A random, valid ModelSpec: 1 to `max_layers` top-level layers (a Repeat has up to 8
    copies of up to 4 layers, a Residual body 1-3 layers), flat inputs of 8-48 features
    at batch 2-256 or images of 1-4 channels, 6-12 pixels a side, at batch 2-8.

    Every step runs in milliseconds, yet its tensors are kilobytes, so the few bytes of
    scalars and of the loss outside the model are far inside a budget's headroom; and
    the batch is mostly larger than the widths, so that activations, not parameters,
    make most of the peak and a budget has something to recompute."""
    if draw(st.booleans()):
        shape: tuple[int, ...] = (draw(st.sampled_from((4, 8, 2))), draw(st.integers(1, 4)),
                                  draw(st.integers(6, 12)), draw(st.integers(6, 12)))
    else:
        shape = (draw(st.sampled_from((64, 128, 256, 16, 2))),
                 draw(st.sampled_from(FEATURES[:-1])))
    input_grad = draw(st.booleans())
    state = _State(shape, fresh=False, mutable=False)
    layers: list[Layer] = []
    for _ in range(draw(st.integers(1, max_layers))):
        layer = draw(_layer(state, keep_shape=False, depth=0))
        layers.append(layer)
        state = _after(layer, state)
    head_kinds = ["linear"] + (["identity", "slice"] if state.fresh else [])
    heads = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(head_kinds))
        if kind == "slice":
            heads.append(Head("slice", draw(st.integers(1, state.shape[1]))))
        else:
            heads.append(Head(kind, draw(st.sampled_from((1, 3, 4))), draw(st.booleans())))
    if not input_grad and not _trainable(tuple(layers)) and not any(
            h.kind == "linear" and not h.frozen for h in heads):
        heads[0] = Head("linear", 4, frozen=False)  # something must require grad
    n_outputs = len(heads) + sum(isinstance(layer, Tap) for layer in layers)
    outputs = draw(st.sampled_from(("tuple", "dict") if n_outputs > 1
                                   else ("tensor", "tuple", "dict")))
    return ModelSpec(shape, input_grad, tuple(layers), tuple(heads), outputs)

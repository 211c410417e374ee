"""Model zoo: `build(name, num_classes, pan=..., norm=..., **options)` returns a flax module.

Models (`NAMES`): mlp, cnn (McMahan et al.'s two-conv CNN, PFLlib's default), vgg9/11/13/16,
resnet20 and mobilenet (MobileNetV1, CIFAR variant); mlp, cnn, vgg* and mobilenet also take
Fed2's grouped structure (`grouped=`). `parse_spec` reads a model written as a call,
`"mlp(hidden=(200, 200))"`.

Every model is called as `model.apply(variables, x, train=False)` on NHWC images and
returns logits. Hidden activations and the penultimate representation (`features`) are
sown into the 'intermediates' collection; `apply_with_intermediates` reads them.

Example:
    >>> import jax, jax.numpy as jnp
    >>> model = build("mlp", 10, pan={"kind": "mul", "period": 1.0, "amplitude": 0.1})
    >>> variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1)))
    >>> count_params(variables)
    2913290
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.models import grouped as grouped_lib
from fedjax_pan.models import layers
from fedjax_pan.models.mlp import MLP
from fedjax_pan.models.mobilenet import MobileNetV1
from fedjax_pan.models.resnet import ResNet, explicit_shortcuts
from fedjax_pan.models.vgg import CONV_PLANS, FC_HIDDEN, VGG, scaled
from fedjax_pan.pan import PANLike, as_config


def _vgg(name: str) -> Callable[..., nn.Module]:
    def make(channels: Optional[Tuple[int, ...]] = None,
             fc_hidden: Optional[Tuple[int, ...]] = None, **kw: Any) -> nn.Module:
        plan = CONV_PLANS[name]
        if channels is not None:
            plan = with_channels(plan, channels)
        return VGG(plan=plan, fc_hidden=FC_HIDDEN[name] if fc_hidden is None else
                   tuple(int(h) for h in fc_hidden), **kw)
    return make


def with_channels(plan: Tuple[Any, ...], channels: Tuple[int, ...]) -> Tuple[Any, ...]:
    """`plan` with its conv widths replaced, in order, by `channels` (pools kept)."""
    convs = sum(1 for item in plan if item != "M")
    if len(channels) != convs or any(int(c) < 1 for c in channels):
        raise ValueError(f"channels must give {convs} positive conv widths, got {channels}")
    it = iter(int(c) for c in channels)
    return tuple(item if item == "M" else next(it) for item in plan)


def _cnn(channels: Tuple[int, ...] = (32, 64), fc_hidden: Tuple[int, ...] = (512,),
         kernel: int = 5, **kw: Any) -> nn.Module:
    """McMahan et al.'s CNN (AISTATS 2017; PFLlib's FedAvgCNN): 5x5 convs of 32 and 64
    channels, each followed by a 2x2 max pool, FC 512, head. The convs pad 'same', so 28x28
    inputs flatten 7x7x64 (PFLlib's unpadded convs flatten 4x4x64)."""
    plan = tuple(x for c in channels for x in (int(c), "M"))
    return VGG(plan=plan, fc_hidden=tuple(int(h) for h in fc_hidden), kernel=int(kernel),
               **kw)


# name -> (constructor, default norm)
_REGISTRY: Dict[str, Tuple[Callable[..., nn.Module], str]] = {
    "mlp": (MLP, "none"),
    "cnn": (_cnn, "none"),
    "vgg9": (_vgg("vgg9"), "none"),
    "vgg11": (_vgg("vgg11"), "none"),
    "vgg13": (_vgg("vgg13"), "none"),
    "vgg16": (_vgg("vgg16"), "none"),
    "resnet20": (ResNet, "batch"),
    "mobilenet": (MobileNetV1, "batch"),
}
_OPTIONS = {
    "mlp": {"hidden", "grouped"},
    "cnn": {"channels", "fc_hidden", "kernel", "pan_fc", "width", "grouped"},
    "vgg9": {"pan_fc", "width", "grouped", "channels", "fc_hidden"},
    "vgg11": {"width", "grouped", "channels"},
    "vgg13": {"width", "grouped", "channels"},
    "vgg16": {"width", "grouped", "channels"},
    "resnet20": {"widths", "stem_width", "blocks_per_stage", "explicit_shortcuts"},
    "mobilenet": {"width", "grouped"},
}
NAMES = tuple(_REGISTRY)


def build(name: str, num_classes: int, pan: PANLike = None, norm: Optional[str] = None,
          num_groups: Optional[int] = None, **options: Any) -> nn.Module:
    """Builds model `name` with `num_classes` outputs.

    pan: None (off), a PANConfig or a mapping of its fields. norm: 'none' | 'batch' |
    'group' | 'group(G)' (None = the model's default: batch for resnet20 and mobilenet,
    else none). options: per-model extras (mlp: hidden; vgg9: pan_fc, width, fc_hidden;
    vggN and mobilenet: width; vgg*: channels, every conv's width in order (before
    `width` scales them); mlp, vgg* and mobilenet: grouped, a `GroupedConfig` or mapping of its
    fields (Fed2 groups); resnet20: widths, stem_width, blocks_per_stage,
    explicit_shortcuts).
    """
    key = str(name).lower()
    if key not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(NAMES)}")
    if not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    unknown = set(options) - _OPTIONS[key]
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for model {key!r}; "
                         f"accepted: {sorted(_OPTIONS[key]) or 'none'}")
    ctor, default_norm = _REGISTRY[key]
    kind, groups = layers.parse_norm(norm if norm is not None else default_norm, num_groups)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    _check_sizes(key, options)
    if "grouped" in options:
        options["grouped"] = grouped_lib.as_grouped(options["grouped"])
        if options["grouped"] is not None:
            options["grouped"].class_map(int(num_classes))  # fails early on a bad map
    return ctor(num_classes=int(num_classes), pan=as_config(pan), norm=kind, groups=groups,
                **options)


# Options that size layers, checked before any layer is built (a bad one would otherwise
# fail deep inside flax with an error naming no option).
_SIZE_SEQUENCES = ("hidden", "channels", "fc_hidden", "widths")
_SIZE_INTEGERS = ("kernel", "stem_width", "blocks_per_stage")
_SIZE_NUMBERS = ("width",)


def _check_sizes(name: str, options: Dict[str, Any]) -> None:
    def positive_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
    for key, value in options.items():
        if key in _SIZE_SEQUENCES and not (isinstance(value, tuple) and
                                           all(positive_int(v) for v in value)):
            raise ValueError(f"model {name!r}: option {key} must be a list of positive "
                             f"integers, got {value!r}")
        if key in _SIZE_INTEGERS and not positive_int(value):
            raise ValueError(f"model {name!r}: option {key} must be a positive integer, "
                             f"got {value!r}")
        if key in _SIZE_NUMBERS and not (isinstance(value, (int, float, np.number)) and
                                         not isinstance(value, bool) and value > 0):
            raise ValueError(f"model {name!r}: option {key} must be a positive number, "
                             f"got {value!r}")


def parse_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
    """(name, options) of a model written as a call with literal keyword arguments:
    `"mlp"`, `"mlp(hidden=(200, 200))"`, `"cnn(channels=(16, 32), norm='group')"`
    (`norm` is `build`'s; the rest are the model's options, checked by `build`)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"model spec {spec!r}: {why}; write a model name, optionally "
                          "called with keyword options, e.g. \"mlp(hidden=(200, 200))\"")
    try:
        tree = ast.parse(str(spec).strip(), mode="eval").body
    except SyntaxError:
        raise bad("not a name or a call") from None
    call = tree if isinstance(tree, ast.Call) else None
    func = call.func if call is not None else tree
    if not isinstance(func, ast.Name) or (call is not None and call.args):
        raise bad("not a name or a call with keyword arguments only")
    name = func.id.lower()
    if name not in _REGISTRY:
        raise bad(f"unknown model {func.id!r} (available: {', '.join(NAMES)})")
    options = {}
    for kw in (call.keywords if call is not None else []):
        if kw.arg is None:
            raise bad("** arguments are not accepted")
        try:
            options[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            raise bad(f"option {kw.arg} is not a literal") from None
    unknown = set(options) - _OPTIONS[name] - {"norm"}
    if unknown:
        raise bad(f"unknown option(s) {sorted(unknown)} for model {name!r} (accepted: "
                  f"{sorted(_OPTIONS[name] | {'norm'})})")
    return name, options


def from_spec(spec: str, num_classes: int, pan: PANLike = None,
              norm: Optional[str] = None) -> nn.Module:
    """The model `spec` (`parse_spec`) describes; its own `norm` option wins over `norm`."""
    name, options = parse_spec(spec)
    norm = options.pop("norm", norm)
    return build(name, num_classes, pan=pan, norm=norm, **options)


def spec_texts(text: str) -> List[str]:
    """The model specs written in `text`, separated by ';' ('': none)."""
    specs = [s.strip() for s in str(text).split(";")]
    return [] if specs == [""] else specs


def specs_error(text: Any) -> Optional[str]:
    """None when `text` is '' or model specs separated by ';' that build, else what it
    must be (a config rule: the options checked before any data loads)."""
    try:
        for spec in spec_texts(text):
            from_spec(spec, 10)
    except (TypeError, ValueError) as e:
        return f"'' or model specs separated by ';' ({e})"
    return None


def layer_order(model: nn.Module, params: Mapping[str, Any]) -> List[str]:
    """The top-level parameter scopes of `params` in the order `model` calls them (params
    dicts come back from flax and jax sorted by name: on ResNet20 and MobileNet the
    stem's normalisation sorts last). A scope belongs to the weight layer whose name it
    is or extends (`stem_norm` to `stem`); a layer's scopes keep their order by name."""
    declared = list(model.weight_layers())
    index = {name: i for i, name in enumerate(declared)}

    def owner(scope: str) -> int:
        owners = [w for w in declared if scope == w or scope.startswith(w + "_")]
        if not owners:
            raise ValueError(f"parameter scope {scope!r} belongs to none of "
                             f"{type(model).__name__}'s weight layers {declared}")
        return index[max(owners, key=len)]
    return sorted(params, key=lambda scope: (owner(scope), scope))


def widths(model: nn.Module) -> Dict[str, int]:
    """Hidden weight layer name -> its number of neurons (MLP and VGG)."""
    if isinstance(model, MLP):
        return {f"fc{i}": int(h) for i, h in enumerate(model.hidden, start=1)}
    if isinstance(model, VGG):
        convs = [int(c) for c in model.plan if c != "M"]
        out = {f"conv{i}": scaled(c, model.width) for i, c in enumerate(convs, start=1)}
        out.update({f"fc{i}": scaled(int(h), model.width)
                    for i, h in enumerate(model.fc_hidden, start=1)})
        return out
    raise ValueError(f"{type(model).__name__} has no resizable widths (MLP and VGG do)")


def resized(model: nn.Module, new_widths: Mapping[str, int]) -> nn.Module:
    """`model` with the named hidden layers' widths changed (MLP and VGG; e.g. FedMA's
    global model, whose matched layers grow)."""
    current = widths(model)
    unknown = set(new_widths) - set(current)
    if unknown:
        raise ValueError(f"no hidden layer(s) {sorted(unknown)} in {type(model).__name__}; "
                         f"it has {sorted(current)}")
    w = {**current, **{k: int(v) for k, v in new_widths.items()}}
    if isinstance(model, MLP):
        return model.clone(hidden=tuple(w[f"fc{i}"] for i in range(1, len(model.hidden) + 1)),
                           parent=None)
    convs = tuple(w[f"conv{i}"] for i in range(1, len(model.weight_layers())
                                               - len(model.fc_hidden)))
    fcs = tuple(w[f"fc{i}"] for i in range(1, len(model.fc_hidden) + 1))
    return model.clone(plan=with_channels(model.plan, convs), fc_hidden=fcs, width=1.0,
                       parent=None)


def init(model: nn.Module, rng: jax.Array, input_shape: Tuple[int, ...]) -> Dict[str, Any]:
    """Initial variables ({'params': ..., 'batch_stats': ...}) for inputs of `input_shape` (HWC).

    Analysis-only collections (intermediates, perturbations) are left out.
    """
    # One compiled program; run eagerly, init compiles every random op separately (slow).
    @jax.jit
    def _init(key):
        variables = model.init(key, jnp.zeros((1, *input_shape), jnp.float32), train=False)
        return {k: v for k, v in variables.items()
                if k not in ("intermediates", layers.PERTURBATIONS, layers.PREACTIVATIONS)}
    return _init(rng)


def activation_gradients(model: nn.Module, variables: Mapping[str, Any], x: jnp.ndarray,
                         output_fn) -> Tuple[Dict[str, jnp.ndarray], Dict[str, jnp.ndarray]]:
    """(activations, d output_fn(logits) / d activations) for every sown layer, eval mode.

    `output_fn` maps logits (B, C) to a scalar, e.g. the sum of each example's own-class logit.
    """
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x, train=False))
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                   shapes[layers.PERTURBATIONS])

    def f(perturbations):
        logits, state = model.apply({**variables, layers.PERTURBATIONS: perturbations}, x,
                                    train=False, mutable=["intermediates"])
        return output_fn(logits), state["intermediates"]

    grads, inter = jax.grad(f, has_aux=True)(zeros)
    cut = len(layers.SOW_SUFFIX)
    strip = lambda tree: {k[:-cut]: v for k, v in tree.items()}  # noqa: E731
    return strip(inter), strip(grads)


def apply_with_intermediates(model: nn.Module, variables: Mapping[str, Any], x: jnp.ndarray,
                             train: bool = False, pre_relu: bool = False
                             ) -> Tuple[jnp.ndarray, Dict[str, jnp.ndarray]]:
    """Logits and every sown activation (by layer name, plus 'features'); with `pre_relu`,
    every hidden layer's post-PAN, pre-ReLU output instead, plus 'head' (the logits)."""
    collection = layers.PREACTIVATIONS if pre_relu else "intermediates"
    mutable = [collection] + (["batch_stats"] if train and "batch_stats" in variables else [])
    logits, state = model.apply(variables, x, train=train, mutable=mutable)
    cut = len(layers.PRE_SUFFIX if pre_relu else layers.SOW_SUFFIX)
    return logits, {k[:-cut]: v for k, v in state[collection].items()}


def group_owners(model: nn.Module, variables: Mapping[str, Any]) -> grouped_lib.Owners:
    """Per grouped leaf of `variables`: (axis over groups, owner group of each index); empty
    for a model without groups (see `fedjax_pan.models.grouped`)."""
    gc = getattr(model, "grouped", None)
    if gc is None:
        return {}
    return grouped_lib.group_owners(variables, model.group_layout(), int(gc.groups),
                                    gc.class_map(model.num_classes))


def count_params(variables: Mapping[str, Any]) -> int:
    """Number of trainable scalars (the 'params' collection only)."""
    params = variables.get("params", variables)
    return int(sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(params)))


__all__ = ["build", "init", "widths", "resized", "with_channels", "apply_with_intermediates",
           "activation_gradients", "count_params", "group_owners", "NAMES", "MLP", "VGG",
           "ResNet", "MobileNetV1", "explicit_shortcuts"]

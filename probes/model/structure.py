"""Static view of a model: the registered tree plus everything reachable but unregistered.

Pure functions over the model object: no hooks, no forward pass, no tensor values read
(so lazy, parametrized, pruned and meta-device models are fine).
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
import enum
import functools
import sys
import types
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..schema import ModuleKind, TensorKind, attr_path, item_path, key_path, member_path
from . import tensors

# Attributes every nn.Module carries for its own bookkeeping: never user data.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {
    "_compiled_call_impl", "call_super_init", "dump_patches", "_version",
}
_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice, enum.Enum,
          torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.FrameType, types.GeneratorType, types.CoroutineType,
           property, classmethod, staticmethod)
# Packages whose objects hold no user layers: the walk does not enter them. The frameworks' own objects
# (a LightningModule holds its Trainer, whose profiler holds a weakref.proxy of the model) are among them.
_SKIP_PACKAGES = ("torch", "numpy", "logging", "threading", "multiprocessing", "concurrent",
                  "asyncio", "io", "_io", "socket", "ssl", "sqlite3", "queue", "weakref", "abc",
                  "builtins", "re", "functools", "typing", "pathlib", "tokenizers", "probes",
                  "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")
MAX_WALK_NODES = 200_000
MAX_WALK_DEPTH = 24

# Modules whose computation depends on .training.
_MODE_SENSITIVE = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm,
                   nn.modules.instancenorm._InstanceNorm, nn.RNNBase)
_SATURATING = {"Tanh": "tanh", "Hardtanh": "tanh", "Softsign": "tanh",
               "Sigmoid": "sigmoid", "Hardsigmoid": "sigmoid", "LogSigmoid": None}


# Wrappers PyTorch puts around a module: transparent here, so that paths are the user's (no `module.`,
# `_orig_mod.`, `_fsdp_wrapped_module.` or `_checkpoint_wrapped_module.`), as torch.distributed.checkpoint
# names them (its state_dict._get_fqns strips the same).
_WRAPPER_ATTRS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_WRAPPER_TYPES = frozenset({"DistributedDataParallel", "DataParallel", "OptimizedModule",
                            "FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper"})
_FLAT_PARAM = "_flat_param"


def is_wrapper(module: nn.Module) -> bool:
    """DDP, DataParallel, FSDP, torch.compile's OptimizedModule, activation-checkpoint wrappers."""
    return type(module).__name__ in _WRAPPER_TYPES and any(
        isinstance(getattr(module, a, None), nn.Module) for a in ("module", *_WRAPPER_ATTRS))


def user_class(cls: type) -> type:
    """The user's class of a module: FSDP2's fully_shard() swaps a module's class for a subclass named
    ``FSDP<Name>``; the class the user wrote is the base after FSDPModule."""
    names = [c.__name__ for c in cls.__mro__]
    if "FSDPModule" in names and cls.__name__.startswith("FSDP"):
        for base in cls.__bases__:
            if base.__name__ != "FSDPModule":
                return base
    return cls


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrappers around it."""
    while is_wrapper(model):
        for attr in ("module", *_WRAPPER_ATTRS):
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module):
                model = inner
                break
    return model


def clean_path(path: str, wrapper_paths: frozenset[str] = frozenset()) -> str:
    """``path`` without the components wrappers add: the wrappers' own attribute names, and the child
    of a wrapper at one of ``wrapper_paths`` (DDP's ``module``)."""
    parts = path.split(".") if path else []
    out: list[str] = []
    for i, part in enumerate(parts):
        if part in _WRAPPER_ATTRS or (part == "module" and ".".join(parts[:i]) in wrapper_paths):
            continue
        out.append(part)
    return ".".join(out)


def is_mode_sensitive(module: nn.Module) -> bool:
    """A module whose computation depends on .training: BatchNorm with running statistics, InstanceNorm tracking
    them, and dropout or drop-path that drops something (p > 0: a Dropout(p=0), as LLM fine-tuning configures them
    all, computes the same in both modes)."""
    if isinstance(module, nn.RNNBase):
        return bool(getattr(module, "dropout", 0.0))
    if isinstance(module, nn.modules.dropout._DropoutNd):
        p = getattr(module, "p", None)
        return not isinstance(p, (int, float)) or p != 0
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return bool(getattr(module, "track_running_stats", False))
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        # without running statistics (TENT's configuration) it normalizes by the batch in both modes
        return module.running_mean is not None or module.running_var is not None
    if type(module).__name__ in _DROP_PATH:      # timm's DropPath (drop_prob), torchvision's StochasticDepth (p)
        p = getattr(module, "drop_prob", getattr(module, "p", None))
        return not isinstance(p, (int, float)) or p != 0
    return isinstance(module, _MODE_SENSITIVE)


# modules that zero whole samples at random in training, by class name (timm's DropPath, torchvision's StochasticDepth)
_DROP_PATH = frozenset({"DropPath", "StochasticDepth"})


def drops_at_random(module: nn.Module) -> bool:
    """Dropout of any kind: the zeros of its output are drawn at random, not units that died."""
    return isinstance(module, nn.modules.dropout._DropoutNd) or type(module).__name__ in _DROP_PATH


def has_no_forward(module: nn.Module) -> bool:
    """A module whose class defines no forward (ParameterList, ParameterDict, a plain holder of a mixture of experts'
    stacked weights): it cannot be called, only its parameters read."""
    return getattr(type(module), "forward", None) is nn.Module.forward


def saturation_kind(module: nn.Module) -> str | None:
    """'tanh' (tails |x| > 0.99), 'sigmoid' (x < 0.01 or x > 0.99) or None."""
    return _SATURATING.get(type(module).__name__)


def unit_dim(module: nn.Module, ndim: int) -> int:
    """Dimension holding the units: channels (dim 1) for conv-like outputs, else the last."""
    if ndim <= 2:
        return ndim - 1 if ndim > 0 else 0
    if ndim >= 4:
        return 1
    conv_like = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm,
                 nn.modules.instancenorm._InstanceNorm, nn.modules.pooling._MaxPoolNd,
                 nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
                 nn.modules.pooling._AdaptiveMaxPoolNd, nn.GroupNorm)
    return 1 if isinstance(module, conv_like) else ndim - 1


def is_uninitialized(t: torch.Tensor) -> bool:
    return nn.parameter.is_lazy(t)


def tensor_shape(t: torch.Tensor) -> list[int] | None:
    return None if is_uninitialized(t) else list(t.shape)


def tensor_numel(t: torch.Tensor) -> int:
    return 0 if is_uninitialized(t) else int(t.numel())


@dataclasses.dataclass
class ModuleNode:
    module_id: int
    path: str
    parent_id: int | None
    name: str
    type: str
    type_module: str
    kind: ModuleKind
    depth: int
    module: nn.Module | None       # dropped (set None) when the watcher closes
    aliases: list[str] = dataclasses.field(default_factory=list)
    n_children: int = 0
    params_total: int = 0
    params_trainable: int = 0
    params_in_optimizer: int = 0
    top_level_unregistered: bool = False


@dataclasses.dataclass
class TensorNode:
    param_id: int
    path: str
    module_id: int | None
    name: str
    kind: TensorKind
    registered: bool
    is_parameter: bool
    in_state_dict: bool
    requires_grad: bool
    shape: list[int] | None
    numel: int
    dtype: str
    device: str
    tensor: torch.Tensor | None
    aliases: list[str] = dataclasses.field(default_factory=list)
    opt_index: int | None = None
    opt_group: int | None = None
    lr: float | None = None

    @property
    def in_optimizer(self) -> bool:
        return self.opt_index is not None

    @property
    def trainable(self) -> bool:
        """A tensor autograd can train: a Parameter or requires_grad, never a buffer."""
        return self.kind != TensorKind.BUFFER and (self.requires_grad or self.is_parameter)


@dataclasses.dataclass
class StaleTensor:
    opt_index: int
    group: int
    index: int
    shape: list[int] | None
    numel: int
    looks_like: str | None          # a registered parameter of the same shape that is not in the optimizer


@dataclasses.dataclass
class ModelStructure:
    modules: list[ModuleNode]
    tensors: list[TensorNode]
    stale: list[StaleTensor]
    walk_truncated: bool
    n_optimizers: int
    wrappers: frozenset[int] = frozenset()       # id() of the wrapper modules inside the model
    sharded: bool = False                        # FSDP or sharded DTensors: ranks hold different parts



def normalize_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """None, one optimizer, or a list/tuple of them (GAN) -> list. Raises on anything else."""
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for i, opt in enumerate(items):
        if not isinstance(opt, torch.optim.Optimizer):
            where = f"optimizer[{i}]" if isinstance(optimizer, (list, tuple)) else "optimizer"
            raise TypeError(f"{where} must be a torch.optim.Optimizer (or a list of them), "
                            f"got {type(opt).__module__}.{type(opt).__qualname__}: {opt!r:.80}")
    return items


_CONTAINERS = (list, tuple, collections.deque, collections.abc.Mapping, set, frozenset)


def _should_descend(obj: Any) -> bool:
    if isinstance(obj, (*_ATOMS, *_OPAQUE)):
        return False
    if isinstance(obj, (*_CONTAINERS, types.SimpleNamespace)):
        return True
    mod = type(obj).__module__ or ""
    top = mod.split(".", 1)[0]
    return not (top in _SKIP_PACKAGES or (mod in sys.stdlib_module_names and mod not in ("collections", "types")))


class _Builder:
    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizers = optimizers
        self.modules: list[ModuleNode] = []
        self.tensors: list[TensorNode] = []
        self.module_by_id: dict[int, ModuleNode] = {}
        self.tensor_by_id: dict[int, TensorNode] = {}
        self.walk_nodes = 0
        self.truncated = False
        self.wrappers: set[int] = set()

    # -- registered -------------------------------------------------------------------------
    def add_module(self, module: nn.Module, path: str, parent: ModuleNode | None, name: str,
                   kind: ModuleKind) -> ModuleNode:
        cls = user_class(type(module))
        node = ModuleNode(module_id=len(self.modules), path=path,
                          parent_id=parent.module_id if parent else None, name=name,
                          type=cls.__name__, type_module=cls.__module__, kind=kind,
                          depth=(parent.depth + 1) if parent else 0, module=module)
        self.modules.append(node)
        self.module_by_id[id(module)] = node
        if parent is not None:
            parent.n_children += 1
        return node

    def add_tensor(self, t: torch.Tensor, path: str, owner: ModuleNode | None, name: str, kind: TensorKind,
                   registered: bool, in_state_dict: bool) -> TensorNode:
        node = TensorNode(
            param_id=len(self.tensors), path=path, module_id=owner.module_id if owner else None,
            name=name, kind=kind, registered=registered, is_parameter=isinstance(t, nn.Parameter),
            in_state_dict=in_state_dict, requires_grad=bool(t.requires_grad), shape=tensor_shape(t),
            numel=tensor_numel(t), dtype=str(t.dtype).replace("torch.", ""), device=str(t.device),
            tensor=t)
        self.tensors.append(node)
        self.tensor_by_id[id(t)] = node
        return node

    def registered(self) -> None:
        path_to_node: dict[str, ModuleNode] = {}
        wrapper_paths: set[str] = set()
        for raw, module in self.model.named_modules(remove_duplicate=False):
            if is_wrapper(module):            # transparent: its wrapped module takes its place
                self.wrappers.add(id(module))
                wrapper_paths.add(raw)
                continue
            path = clean_path(raw, frozenset(wrapper_paths))
            known = self.module_by_id.get(id(module))
            if known is not None:            # the same module under a second name (aliasing)
                if path != known.path and path not in known.aliases:
                    known.aliases.append(path)
                path_to_node[path] = known
                continue
            parent_path, _, name = path.rpartition(".")
            parent = path_to_node.get(parent_path) if path else None
            node = self.add_module(module, path, parent, name if path else "", ModuleKind.REGISTERED)
            path_to_node[path] = node
        wrapped = frozenset(wrapper_paths)
        for raw, p in self.model.named_parameters(remove_duplicate=False):
            if raw.rpartition(".")[2] != _FLAT_PARAM:      # FSDP's flat buffer: its views are the parameters
                self._registered_tensor(p, clean_path(raw, wrapped), path_to_node, TensorKind.PARAMETER, True)
        for raw, b in self.model.named_buffers(remove_duplicate=False):
            path = clean_path(raw, wrapped)
            mod_path, _, name = path.rpartition(".")
            owner = path_to_node.get(mod_path)
            persistent = owner is None or name not in getattr(owner.module, "_non_persistent_buffers_set", ())
            self._registered_tensor(b, path, path_to_node, TensorKind.BUFFER, persistent)

    def _registered_tensor(self, t: torch.Tensor, path: str, path_to_node: dict[str, ModuleNode], kind: TensorKind,
                           in_state_dict: bool) -> None:
        known = self.tensor_by_id.get(id(t))
        if known is not None:
            if path != known.path and path not in known.aliases:
                known.aliases.append(path)
            return
        mod_path, _, name = path.rpartition(".")
        self.add_tensor(t, path, path_to_node.get(mod_path), name, kind, True, in_state_dict)

    # -- unregistered -----------------------------------------------------------------------
    def unregistered(self) -> None:
        seen: set[int] = set()
        for node in list(self.modules):       # registered modules, in tree order
            self._walk_module_attrs(node, seen)

    def _walk_module_attrs(self, node: ModuleNode, seen: set[int]) -> None:
        module = node.module
        if module is None:          # the watcher has closed
            return
        attrs = vars(module)
        registered_params = module._parameters
        for name, value in list(attrs.items()):
            if name in _MODULE_INTERNALS or name.startswith("__"):
                continue
            if isinstance(value, torch.Tensor) and f"{name}_orig" in registered_params:
                continue        # torch.nn.utils.prune recomputes `name` from name_orig * mask
            self._visit(value, attr_path(node.path, name), node, seen, 0)

    def _visit(self, obj: Any, path: str, owner: ModuleNode, seen: set[int], depth: int) -> None:
        if self.walk_nodes >= MAX_WALK_NODES or depth > MAX_WALK_DEPTH:
            self.truncated = True
            return
        self.walk_nodes += 1
        if isinstance(obj, weakref.ProxyTypes):
            return          # a weak proxy passes isinstance(nn.Module) under another id: never the user's layer
        if isinstance(obj, nn.Module):
            if id(obj) in self.module_by_id or id(obj) in self.wrappers:
                return
            self._add_unregistered_module(obj, path, owner, seen)
            return
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.tensor_by_id or obj.grad_fn is not None:
                return      # registered elsewhere, or a computed (non-leaf) value, not state
            name = path.rsplit(".", 1)[-1]
            self.add_tensor(obj, path, owner, name, TensorKind.TENSOR, False, False)
            return
        if not _should_descend(obj) or id(obj) in seen:
            return
        seen.add(id(obj))
        for item, item_at in _contents(obj, path):
            self._visit(item, item_at, owner, seen, depth + 1)

    def _add_unregistered_module(self, module: nn.Module, path: str, owner: ModuleNode,
                                 seen: set[int]) -> None:
        name = path[len(owner.path) + 1:] if owner.path else path
        top = self.add_module(module, path, owner, name, ModuleKind.UNREGISTERED)
        top.top_level_unregistered = True
        sub_nodes = {"": top}
        for sub_path, sub in module.named_modules():
            if not sub_path:
                continue
            if id(sub) in self.module_by_id:
                continue
            parent_path, _, sub_name = sub_path.rpartition(".")
            parent = sub_nodes.get(parent_path, top)
            sub_nodes[sub_path] = self.add_module(sub, attr_path(path, sub_path), parent, sub_name,
                                                  ModuleKind.UNREGISTERED)
        for sub_path, p in list(module.named_parameters()) + list(module.named_buffers()):
            if id(p) in self.tensor_by_id:
                continue
            mod_path, _, tname = sub_path.rpartition(".")
            owner_node = sub_nodes.get(mod_path, top)
            self.add_tensor(p, attr_path(path, sub_path), owner_node, tname, TensorKind.TENSOR, False, False)
        for node in sub_nodes.values():
            self._walk_module_attrs(node, seen)

    # -- optimizers -------------------------------------------------------------------------
    def optimizers_membership(self) -> list[StaleTensor]:
        stale: list[StaleTensor] = []
        for oi, opt in enumerate(self.optimizers):
            for gi, group in enumerate(opt.param_groups):
                # not read when held on an accelerator (a sync); every sampled step's param_stats.lr has it
                lr = tensors.host_number(group.get("lr"))
                for pi, p in enumerate(group.get("params", ())):
                    node = self.tensor_by_id.get(id(p))
                    if node is None:
                        stale.append(StaleTensor(oi, gi, pi, tensor_shape(p), tensor_numel(p), None))
                    elif node.opt_index is None:
                        node.opt_index, node.opt_group, node.lr = oi, gi, lr
        if stale:
            for s in stale:
                for t in self.tensors:
                    if (t.kind == TensorKind.PARAMETER and t.requires_grad and not t.in_optimizer
                            and t.shape == s.shape):
                        s.looks_like = t.path
                        break
        return stale

    # -- counts -----------------------------------------------------------------------------
    def counts(self) -> None:
        for t in self.tensors:
            if t.module_id is None or (not t.trainable and t.kind != TensorKind.PARAMETER):
                continue
            node = self.modules[t.module_id]
            node.params_total += t.numel
            if t.requires_grad:
                node.params_trainable += t.numel
            if t.in_optimizer:
                node.params_in_optimizer += t.numel
        for node in reversed(self.modules):         # children always come after their parent
            if node.parent_id is not None:
                parent = self.modules[node.parent_id]
                parent.params_total += node.params_total
                parent.params_trainable += node.params_trainable
                parent.params_in_optimizer += node.params_in_optimizer


def build_structure(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> ModelStructure:
    """The structure of the user's module (wrappers around it or inside it are transparent)."""
    b = _Builder(unwrap(model), optimizers)
    b.registered()
    b.unregistered()
    stale = b.optimizers_membership()
    b.counts()
    sharded = any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()) or any(
        type(t.tensor).__name__ == "DTensor" for t in b.tensors if t.tensor is not None) or any(
        "FSDPModule" in (c.__name__ for c in type(m).__mro__) for m in model.modules())
    return ModelStructure(modules=b.modules, tensors=b.tensors, stale=stale, walk_truncated=b.truncated,
                          n_optimizers=len(optimizers), wrappers=frozenset(b.wrappers), sharded=sharded)


def subtree_has_state_or_modes(module: nn.Module) -> bool:
    """True when a module matters to the optimizer/state_dict/.to()/eval(): it holds parameters or buffers, or
    behaves differently in training and eval (a mode-sensitive layer, or a forward that reads ``self.training``).
    A stateless helper held in a plain dict (transformers' ``_kernel_funcs``) matters to none of them."""
    for m in module.modules():
        if any(v is not None for v in m._parameters.values()) or \
                any(v is not None for v in m._buffers.values()) or is_mode_sensitive(m) or reads_training_flag(m):
            return True
    return False


def reads_training_flag(module: nn.Module) -> bool:
    """Whether the module's class has a forward whose code (or a function defined inside it) reads an attribute
    named ``training``: its output may depend on the mode."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and _code_reads_training(code)


@functools.lru_cache(maxsize=1024)
def _code_reads_training(code: types.CodeType) -> bool:
    if "training" in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and _code_reads_training(c) for c in code.co_consts)


@dataclasses.dataclass(frozen=True)
class CompiledModules:
    """What torch.compile put in a model: ``torch.compile(m)`` wrappers (OptimizedModule, at any depth: the
    model the user calls, or a block replaced by its compiled self), modules compiled in place
    (``m.compile()``, which sets ``_compiled_call_impl``) and methods replaced on an instance by their
    compiled selves (``m.forward = torch.compile(m.forward)``; Lightning's ``from_compiled`` does it to
    ``forward`` and ``training_step``)."""

    wrappers: tuple[nn.Module, ...] = ()
    in_place: tuple[nn.Module, ...] = ()
    methods: tuple[tuple[nn.Module, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.wrappers or self.in_place or self.methods)


def compiled_modules(model: nn.Module) -> CompiledModules:
    wrappers, in_place, methods = [], [], []
    for m in model.modules():
        if type(m).__name__ == "OptimizedModule":
            wrappers.append(m)
            continue
        attrs = m.__dict__
        if attrs.get("_compiled_call_impl") is not None:
            in_place.append(m)
        for name, value in attrs.items():
            # only where removing the instance's attribute gives back the class's own (eager) method
            if type(value) is types.FunctionType and hasattr(value, "_torchdynamo_orig_callable") \
                    and callable(getattr(type(m), name, None)):
                methods.append((m, name))
    return CompiledModules(tuple(wrappers), tuple(in_place), tuple(methods))


def model_device(model: nn.Module) -> str:
    for p in model.parameters():
        return str(p.device)
    return "cpu"


def _contents(obj: Any, path: str) -> Iterable[tuple[Any, str]]:
    """What a container or plain object holds, each with its path: items of sequences, values of mappings, members of
    sets, fields of objects (their ``__dict__`` or ``__slots__``)."""
    if isinstance(obj, (list, tuple, collections.deque)):
        return [(item, item_path(path, i)) for i, item in enumerate(obj)]
    if isinstance(obj, collections.abc.Mapping):
        return [(item, key_path(path, key, i)) for i, (key, item) in enumerate(list(obj.items()))]
    if isinstance(obj, (set, frozenset)):
        return [(item, member_path(path, i)) for i, item in enumerate(obj)]
    fields: Iterable[tuple[str, Any]] = ()
    try:
        if hasattr(obj, "__dict__"):
            fields = list(vars(obj).items())
        elif hasattr(type(obj), "__slots__"):
            slots = [s for k in type(obj).__mro__ for s in getattr(k, "__slots__", ())]
            fields = [(s, getattr(obj, s)) for s in slots if hasattr(obj, s)]
    except Exception:        # exotic objects (proxies) whose attributes raise
        fields = ()
    return [(item, attr_path(path, key)) for key, item in fields if not key.startswith("__")]

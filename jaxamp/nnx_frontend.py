"""The Flax NNX front end: which NNX module runs, and its path, while autocast traces.

NNX has no method interceptor (linen's) and no name scopes: while :func:`intercept_calls` is
active in a thread, every NNX class's ``__call__`` is wrapped (a ``_engine.patching.Patch``),
calls the interceptors with a :class:`Call` and runs under ``jax.named_scope`` of its NNX path
(``blocks/3/attn``), so the audit reads NNX paths as it reads linen's. How paths survive NNX
transforms (:data:`PATH_KEY`): ``jaxamp/_engine/README.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from jaxamp._engine.patching import Patch

__all__ = ["PATH_KEY", "Apply", "Call", "ModuleArgs", "intercept_calls", "is_module",
           "register"]

#: The Variable metadata key that carries its path through NNX transforms.
PATH_KEY = "jaxamp_path"


def is_module(x: Any) -> bool:
    return isinstance(x, nnx.Module)


@dataclasses.dataclass(frozen=True)
class Call:
    """What an interceptor learns about an NNX module call (cf. linen's ``context``)."""

    module: nnx.Module
    path: tuple[str, ...]  # its path from the root, as NNX names it ("blocks", "3", "attn")

    @property
    def cls(self) -> type:
        return type(self.module)


class _Session:
    """Per-thread bookkeeping while at least one :func:`intercept_calls` is active."""

    def __init__(self):
        self.interceptors: list[Callable] = []
        self.paths: dict[int, tuple[nnx.Module, tuple[str, ...]]] = {}
        self.annotated: list[nnx.Variable] = []  # Variables whose PATH_KEY we wrote
        self.calls: list[nnx.Module] = []  # the modules whose __call__ runs, innermost last


def _graph(node) -> Iterator[tuple[tuple[str, ...], Any]]:
    for path, value in nnx.iter_graph(node):
        if isinstance(value, nnx.Module | nnx.Variable):
            yield tuple(str(p) for p in path), value


def register(module: nnx.Module, prefix: tuple[str, ...] = ()) -> None:
    """Registers ``module`` and its graph at ``prefix`` for the calls this thread intercepts
    (nothing if it intercepts none)."""
    stack = _PATCH.stack()
    if not stack:
        return
    session = stack[-1]
    for rel, node in _graph(module):
        path = prefix + rel
        if isinstance(node, nnx.Module):
            session.paths.setdefault(id(node), (node, path))
        elif not node.has_metadata(PATH_KEY):
            try:
                node.set_metadata(PATH_KEY, path)
            except Exception:  # a Variable of another trace: paths inside transforms are lost
                continue
            session.annotated.append(node)


def _path_of(session: _Session, module: nnx.Module) -> tuple[str, ...]:
    known = session.paths.get(id(module))
    if known is not None:
        return known[1]
    for rel, node in _graph(module):  # a module rebuilt inside an NNX transform
        if isinstance(node, nnx.Variable) and node.has_metadata(PATH_KEY):
            full = tuple(node.get_metadata(PATH_KEY))
            if len(full) >= len(rel) and full[len(full) - len(rel):] == rel:
                path = full[:len(full) - len(rel)]
                session.paths[id(module)] = (module, path)  # (keeps it alive: ids stay unique)
                return path
    register(module)  # first met here: a root
    return ()


def _scope_name(session: _Session, module: nnx.Module, path: tuple[str, ...]) -> str:
    """The name-stack segment(s) of a call: the root's class name, else the path below the
    calling module's (``blocks/3`` inside the root, ``attn`` inside a block)."""
    if not path:
        return type(module).__name__
    for outer in reversed(session.calls):
        outer_path = session.paths.get(id(outer), (None, None))[1]
        if outer_path is not None and path[:len(outer_path)] == outer_path:
            rel = path[len(outer_path):]
            return "/".join(rel) if rel else type(module).__name__
    return "/".join(path)


def _call(session: _Session, original: Callable, module: nnx.Module, *args, **kwargs):
    """A module's ``__call__`` in an intercepting thread (the patch's handler)."""
    if session.calls and session.calls[-1] is module:  # super().__call__: the same call
        return original(module, *args, **kwargs)
    path = _path_of(session, module)
    context = Call(module, path)
    fun = functools.partial(original, module)
    for interceptor in reversed(session.interceptors):  # the first one outermost
        fun = functools.partial(_intercepted, interceptor, fun, context)
    scope = _scope_name(session, module, path)
    session.calls.append(module)
    try:
        with jax.named_scope(scope):
            return fun(*args, **kwargs)
    finally:
        session.calls.pop()


def _intercepted(interceptor, next_fun, context, *args, **kwargs):
    return interceptor(next_fun, args, kwargs, context)


def _subclasses(cls: type) -> Iterator[type]:
    seen, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


def _targets() -> Iterator[tuple[type, str]]:
    """Every ``nnx.Module`` class that defines its own ``__call__`` (dunders are looked up on
    the type, so the classes are patched)."""
    for cls in [nnx.Module, *_subclasses(nnx.Module)]:
        own = cls.__dict__.get("__call__")
        if callable(own) and not isinstance(own, staticmethod | classmethod):
            yield cls, "__call__"


_PATCH = Patch(_targets, _call)
installed = _PATCH.installed


@contextlib.contextmanager
def intercept_calls(interceptor: Callable):
    """Calls ``interceptor(next_fun, args, kwargs, context: Call)`` around every NNX module
    ``__call__`` this thread makes inside the block (the first interceptor entered is the
    outermost)."""
    stack = _PATCH.stack()
    outermost = not stack
    session = _Session() if outermost else stack[-1]
    session.interceptors.append(interceptor)
    try:
        with _PATCH.active(session):
            yield session
    finally:
        session.interceptors.pop()
        if outermost:
            for var in session.annotated:
                with contextlib.suppress(Exception):
                    var.del_metadata(PATH_KEY)


# ---- NNX models as autocast arguments: split before tracing, merged as copies inside it ----


_SLOT = type("_Slot", (), {"__repr__": lambda self: "<nnx module>"})()


class ModuleArgs:
    """The NNX modules among a call's arguments, split into one graphdef and one state.

    Inside the trace :meth:`merge` builds copies from the traced state (the user's objects are
    never traced into); afterwards :meth:`write_back` gives the user's Variables the values
    the call changed (BatchNorm statistics), as calling the model would have.
    """

    def __init__(self, args: tuple, kwargs: dict):
        self.leaves, self.treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_module)
        self.modules = [x for x in self.leaves if is_module(x)]
        self.graphdef, self.state = nnx.split(self.modules)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def split(self) -> tuple[tuple, dict]:
        """``((state, args), kwargs)``: the arguments with each module replaced by a slot
        marker, the modules' state first (what autocast traces)."""
        full = [_SLOT if is_module(x) else x for x in self.leaves]
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, full)
        return (self.state, args), kwargs

    def merge(self, args: tuple, kwargs: dict) -> tuple[list, tuple, dict]:
        """Inside the trace: ``(copies, args, kwargs)`` from what :meth:`split` returned, the
        copies merged from the traced state and put back in their slots."""
        state, args = args
        copies = nnx.merge(self.graphdef, state, copy=True)
        for module in copies:
            register(module)
        it = iter(copies)
        full = [next(it) if x is _SLOT else x for x in jax.tree_util.tree_leaves((args, kwargs))]
        a, k = jax.tree_util.tree_unflatten(self.treedef, full)
        return copies, a, k

    @staticmethod
    def values(copies: list) -> dict:
        """The copies' Variable values by path (returned from the trace)."""
        return {path: node.get_value() for path, node in _graph(copies)
                if isinstance(node, nnx.Variable)}

    def write_back(self, values: dict) -> None:
        for path, node in _graph(self.modules):
            if isinstance(node, nnx.Variable) and path in values:
                if values[path] is not node.get_value():
                    node.set_value(values[path])


# ---- NNX models as (params, collections) for the functional train step and diagnostics ----

#: The collection that holds an NNX model's non-parameter state (BatchNorm statistics).
COLLECTION = "nnx_state"


class Apply:
    """A linen-style ``apply`` for an NNX model: ``apply(variables, fn, *args, mutable=...)``
    merges the model from ``variables`` (``{"params": pure dict, "nnx_state": pure dict}``)
    and returns ``fn(model, *args)`` (``fn=None``: ``model(*args)``); with ``mutable`` also
    ``{"nnx_state": new values}`` (the BatchNorm statistics the call updated)."""

    def __init__(self, model: nnx.Module):
        self.graphdef, self.params_template, self.rest_template = nnx.split(
            model, nnx.Param, ...)

    @staticmethod
    def variables(model: nnx.Module) -> dict:
        """``{"params": ..., "nnx_state": ...}`` of ``model`` as pure dicts (what a linen
        ``model.init`` returns)."""
        _, params, rest = nnx.split(model, nnx.Param, ...)
        rest = nnx.to_pure_dict(rest)
        return {"params": nnx.to_pure_dict(params), **({COLLECTION: rest} if rest else {})}

    def model(self, params, rest=None) -> nnx.Module:
        """The model merged from pure-dict params and state (inside a trace: a new object)."""
        p = _from_pure(self.params_template, params)
        r = _from_pure(self.rest_template, rest if rest is not None else {})
        model = nnx.merge(self.graphdef, p, r, copy=True)
        register(model)
        return model

    def __call__(self, variables, fn: Callable | None = None, *args, mutable=False, **kwargs):
        model = self.model(variables["params"], variables.get(COLLECTION))
        out = model(*args, **kwargs) if fn is None else fn(model, *args, **kwargs)
        if not mutable:
            return out
        _, _, rest = nnx.split(model, nnx.Param, ...)
        return out, {COLLECTION: nnx.to_pure_dict(rest)}


def _lookup(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _from_pure(template, pure) -> Any:
    return nnx.from_flat_state([
        (path, jax.tree.unflatten(jax.tree.structure(var), [_lookup(pure, path)]))
        for path, var in nnx.to_flat_state(template)])


def update(model: nnx.Module, variables: dict) -> None:
    """Sets ``model``'s Variables from ``{"params": pure dict, "nnx_state": pure dict}``."""
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            tree = variables.get("params" if isinstance(var, nnx.Param) else COLLECTION, {})
            try:
                value = _lookup(tree, path)
            except (KeyError, IndexError, TypeError):
                continue
            var.set_value(value)


def functional(fn: Callable, args: tuple) -> tuple[Callable, tuple]:
    """``fn`` over NNX models -> a function over their params (plain dicts), for the
    diagnostics, which differentiate and name params as they do for linen.

    ``fn`` may be an NNX module (called as ``fn(*args)``; it becomes argument 0). Each
    positional argument that is an NNX module is replaced by its params; the function merges
    the model again (with its other Variables as they are now) inside the trace.
    """
    if is_module(fn):
        args = (fn, *args)

        def fn(model, *a):
            return model(*a)
    slots = {i: Apply(a) for i, a in enumerate(args) if is_module(a)}
    if not slots:
        return fn, args
    variables = {i: Apply.variables(args[i]) for i in slots}

    def on_params(*a):
        a = list(a)
        for i, apply in slots.items():
            a[i] = apply.model(a[i], variables[i].get(COLLECTION))
        return fn(*a)

    return on_params, tuple(variables[i]["params"] if i in slots else a
                            for i, a in enumerate(args))

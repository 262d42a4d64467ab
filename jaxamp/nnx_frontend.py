"""The Flax NNX front end: where NNX modules begin and end while autocast traces.

linen has a method interceptor (``nn.intercept_methods``); NNX has none, and no name scopes of
its own. This module gives autocast and the diagnostics the same two facts for NNX modules:

* *which module is running*: while :func:`intercept_calls` is active in a thread, every
  ``nnx.Module`` subclass's ``__call__`` goes through a wrapper that calls the interceptors
  with a :class:`Call` (the module, its path, its class), linen-interceptor style, and runs the
  call under ``jax.named_scope`` of its path (the root under its class name, like linen), so
  the audit and the overflow locator read NNX paths from the name stack as they read linen's.
  The wrapper is installed on the classes (Python looks dunders up on the type) while at least
  one thread intercepts, wrapping whatever ``__call__`` each class had (its own, or another
  library's wrapper of it); in a thread that is not intercepting it calls that and nothing
  else. When the last thread stops, each class gets back what it had, unless someone replaced
  the wrapper meanwhile: their function stays (it may call ours, which passes calls through),
  so no one's patch is clobbered. Only ``__call__`` is seen
  (other methods, e.g. ``Embed.attend``, run in their caller's region).
* *its path*, as NNX names it (``blocks/3/attn``): a module passed to autocast (or merged by
  :class:`Apply`) is registered with its whole graph; a module first met in a call is a root
  (path ``()``). NNX transforms (``nnx.scan``, ``nnx.remat``, ``nnx.vmap``) rebuild modules
  inside their traces, so registration also writes each Variable's full path into its metadata
  (key :data:`PATH_KEY`), which those transforms carry along; a rebuilt module takes its path
  from the first Variable it holds. The key is removed again from the Variables of modules
  that exist outside the trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

__all__ = ["PATH_KEY", "Apply", "Call", "ModuleArgs", "intercept_calls", "is_module",
           "register"]

#: The Variable metadata key that carries its path through NNX transforms.
PATH_KEY = "jaxamp_path"

_lock = threading.Lock()
_local = threading.local()
_active = 0  # threads intercepting (the wrappers are installed while > 0)
_originals: dict[type, tuple[Callable, Callable]] = {}  # class -> (what it had, our wrapper)


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


def _session() -> _Session | None:
    return getattr(_local, "session", None)


def _parts(path) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def _graph(node) -> Iterator[tuple[tuple[str, ...], Any]]:
    for path, value in nnx.iter_graph(node):
        if isinstance(value, nnx.Module | nnx.Variable):
            yield _parts(path), value


def register(module: nnx.Module, prefix: tuple[str, ...] = ()) -> None:
    """Registers ``module`` and its graph at ``prefix`` for the calls this thread intercepts
    (nothing if it intercepts none)."""
    session = _session()
    if session is None:
        return
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
    path = None
    for rel, node in _graph(module):  # a module rebuilt inside an NNX transform
        if isinstance(node, nnx.Variable) and node.has_metadata(PATH_KEY):
            full = tuple(node.get_metadata(PATH_KEY))
            if len(full) >= len(rel) and full[len(full) - len(rel):] == rel:
                path = full[:len(full) - len(rel)]
                break
    if path is None:  # first met here: a root
        register(module)
        return ()
    session.paths[id(module)] = (module, path)  # (keeps the module alive: ids stay unique)
    return path


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


def _wrap(cls: type, original: Callable) -> Callable:
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        session = _session()
        if session is None or not session.interceptors:
            return original(self, *args, **kwargs)
        if session.calls and session.calls[-1] is self:  # super().__call__: the same call
            return original(self, *args, **kwargs)
        path = _path_of(session, self)
        context = Call(self, path)

        def run(*a, **k):
            return original(self, *a, **k)

        fun = run
        for interceptor in reversed(session.interceptors):  # the first one outermost
            fun = functools.partial(_intercepted, interceptor, fun, context)
        scope = _scope_name(session, self, path)
        session.calls.append(self)
        try:
            with jax.named_scope(scope):
                return fun(*args, **kwargs)
        finally:
            session.calls.pop()

    __call__.__jaxamp_nnx__ = True
    return __call__


def _intercepted(interceptor, next_fun, context, *args, **kwargs):
    return interceptor(next_fun, args, kwargs, context)


def _subclasses(cls: type) -> Iterator[type]:
    seen = set()
    todo = [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


def _install() -> None:
    """Wraps ``__call__`` of every ``nnx.Module`` subclass that defines one (under _lock); a
    class whose wrapper someone replaced since is wrapped again (around their function)."""
    for cls in [nnx.Module, *_subclasses(nnx.Module)]:
        own = cls.__dict__.get("__call__")
        if own is None or not callable(own) or isinstance(own, staticmethod | classmethod):
            continue
        if cls in _originals and _originals[cls][1] is own:
            continue
        wrapper = _wrap(cls, own)
        _originals[cls] = (own, wrapper)
        type.__setattr__(cls, "__call__", wrapper)


def _uninstall() -> None:
    """Gives each class back what it had, where our wrapper is still the one in place."""
    for cls, (own, wrapper) in _originals.items():
        if cls.__dict__.get("__call__") is wrapper:
            type.__setattr__(cls, "__call__", own)
    _originals.clear()


@contextlib.contextmanager
def intercept_calls(interceptor: Callable):
    """Calls ``interceptor(next_fun, args, kwargs, context: Call)`` around every NNX module
    ``__call__`` this thread makes inside the block (the first interceptor entered is the
    outermost). Classes are restored when the last intercepting thread leaves."""
    global _active
    session = _session()
    outermost = session is None
    if outermost:
        session = _local.session = _Session()
    with _lock:
        _install()  # also wraps classes defined since the last install
        _active += 1
    session.interceptors.append(interceptor)
    try:
        yield session
    finally:
        session.interceptors.pop()
        if outermost:
            for var in session.annotated:
                with contextlib.suppress(Exception):
                    var.del_metadata(PATH_KEY)
            del _local.session
        with _lock:
            _active -= 1
            if _active == 0:
                _uninstall()


def installed() -> bool:
    """Whether the class wrappers are installed now (for tests)."""
    return any(cls.__dict__.get("__call__") is wrapper
               for cls, (_, wrapper) in _originals.items())


# ---------------------------------------------------------------------------------------------
# NNX models as autocast arguments: split before tracing, merged as a copy inside it
# ---------------------------------------------------------------------------------------------


_SLOT = type("_Slot", (), {"__repr__": lambda self: "<nnx module>"})()


class ModuleArgs:
    """The NNX modules among a call's arguments, split into one graphdef and one state.

    Inside the trace :meth:`merge` builds copies from the traced state (the user's objects are
    never traced into); afterwards :meth:`write_back` gives the user's Variables the values
    the call changed (BatchNorm statistics), as calling the model would have.
    """

    def __init__(self, args: tuple, kwargs: dict):
        tree, self.treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_module)
        self.slots = [i for i, x in enumerate(tree) if is_module(x)]
        self.leaves = tree
        self.modules = [tree[i] for i in self.slots]
        self.graphdef, self.state = nnx.split(self.modules)

    def __bool__(self) -> bool:
        return bool(self.slots)

    def split(self) -> tuple[tuple, dict]:
        """``((state, args), kwargs)``: the arguments with each module replaced by a slot
        marker, the modules' state first (what autocast traces)."""
        full = [_SLOT if i in self.slots else x for i, x in enumerate(self.leaves)]
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, full)
        return (self.state, args), kwargs

    def merge(self, args: tuple, kwargs: dict) -> tuple[list, tuple, dict]:
        """Inside the trace: ``(copies, args, kwargs)`` from what :meth:`split` returned, the
        copies merged from the traced state and put back in their slots."""
        state, args = args
        copies = nnx.merge(self.graphdef, state, copy=True)
        for module in copies:
            register(module)
        full = jax.tree_util.tree_leaves((args, kwargs))
        it = iter(copies)
        full = [next(it) if x is _SLOT else x for x in full]
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
                new = values[path]
                if new is not node.get_value():
                    node.set_value(new)


# ---------------------------------------------------------------------------------------------
# NNX models as (params, collections) for the functional train step and the diagnostics
# ---------------------------------------------------------------------------------------------


class Apply:
    """A linen-style ``apply`` for an NNX model: ``apply(variables, fn, *args, mutable=...)``
    merges the model from ``variables`` (``{"params": pure dict, "nnx_state": pure dict}``)
    and returns ``fn(model, *args)`` (``fn=None``: ``model(*args)``); with ``mutable`` also
    ``{"nnx_state": new values}`` (the BatchNorm statistics the call updated)."""

    def __init__(self, model: nnx.Module):
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.params_template = params
        self.rest_template = rest

    @staticmethod
    def variables(model: nnx.Module) -> dict:
        """``{"params": ..., "nnx_state": ...}`` of ``model`` as pure dicts (what a linen
        ``model.init`` returns: plain nested dicts of arrays)."""
        _, params, rest = nnx.split(model, nnx.Param, ...)
        out = {"params": nnx.to_pure_dict(params)}
        rest = nnx.to_pure_dict(rest)
        if rest:
            out[COLLECTION] = rest
        return out

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


#: The collection that holds an NNX model's non-parameter state (BatchNorm statistics).
COLLECTION = "nnx_state"


def _from_pure(template, pure) -> Any:
    flat = []
    for path, var in nnx.to_flat_state(template):
        value = pure
        for key in path:
            value = value[key]
        flat.append((path, jax.tree.unflatten(jax.tree.structure(var), [value])))
    return nnx.from_flat_state(flat)


def update(model: nnx.Module, variables: dict) -> None:
    """Sets ``model``'s Variables from ``{"params": pure dict, "nnx_state": pure dict}``."""
    params = variables.get("params", {})
    rest = variables.get(COLLECTION, {})
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        tree = params if isinstance(var, nnx.Param) else rest
        value = tree
        try:
            for key in path:
                value = value[key]
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

"""``autocast``: run an unmodified JAX/Flax function under mixed-precision policies.

The function is traced once in its own (float32) dtypes, each Flax module call (linen, or NNX
through :mod:`jaxamp.nnx_frontend`) marked as a region with its policy; the jaxpr is then
re-evaluated equation by equation, each primitive bound in the dtype its op rule
(:mod:`jaxamp.rules`) and its region's policy ask for. The result is ordinary JAX code:
``jax.grad``, ``jax.jit`` and ``jax.vmap`` compose with it, and the backward pass follows the
forward's dtypes. The design (regions, casts, control flow, weight gradients across devices,
trace cost) is jaxamp/_engine/README.md.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import functools
import inspect
import itertools
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jmp
import numpy as np

from jaxamp import nnx_frontend
from jaxamp._engine import attention
from jaxamp._engine.compat import Tracer, mesh_is_set
from jaxamp._engine.context import Marks
from jaxamp._engine.control import rule_table
from jaxamp._engine.evaluator import COUNTERS, Evaluator
from jaxamp._engine.jaxpr import param_matmuls
from jaxamp._engine.primitives import FP8_MATMUL, PARAM_READS
from jaxamp._engine.values import F64, Value, cast, dtype_of
from jaxamp.fp8 import delayed_active
from jaxamp.policy_spec import DEFAULT_POLICY
from jaxamp.rules import DEFAULT_OP_RULES, ModuleRules, OpRules, module_path

__all__ = ["autocast", "check_options", "counting_evaluations", "float64_cause",
           "float64_inputs"]


def __getattr__(name: str) -> Any:
    if name == "REGION_MARKER":  # deprecated: jaxamp reads marks from a table, never a name
        warnings.warn("jaxamp.engine.REGION_MARKER is deprecated and will be removed: the "
                      "scopes autocast puts in the name stack are opaque names, looked up in "
                      "a table, not parsed.", DeprecationWarning, stacklevel=2)
        return re.compile(r"jaxamp<(\d+)\.(\d+)>")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CALLS = itertools.count(1)
#: Evaluate module calls whose structure repeats (a Transformer's layers) once and replay them
#: (:mod:`jaxamp._engine.sharing`): the same program, traced faster. False evaluates every equation
#: in place.
SHARE_REPEATED_CALLS = True


@contextlib.contextmanager
def counting_evaluations():
    """Counts how often autocast evaluates each jaxpr (a program, a body) while the block runs.

    For benchmarks and tests of the trace cost: yields a ``collections.Counter`` keyed by the
    jaxpr's ``id``; ``max(counter.values())`` is the busiest jaxpr's count.
    """
    counter: collections.Counter = collections.Counter()
    COUNTERS.append(counter)
    try:
        yield counter
    finally:
        COUNTERS.remove(counter)


class _Regions:
    """The region table filled while tracing: region id -> policy (id 0: the default; None:
    a module call that no rule matched, which inherits its caller's policy). Every module call
    gets an id and a scope from the call's :class:`Marks`, so the evaluator sees where each
    call begins and ends."""

    def __init__(self, rules: ModuleRules):
        self.rules = rules
        self.policies: list[jmp.Policy | None] = [rules.default]
        self.matched_patterns: set[str] = set()
        self.seen_paths: list[str] = []  # every module path met, in order (for warnings)
        self.stack: list[tuple[Any, jmp.Policy]] = []  # (module, effective policy)
        self.matches: dict = {}  # (class, path, inherited) -> rules.match(...)
        self.marks = Marks(next(_CALLS))  # the scopes of its module calls
        self.attention = attention.Recorder(self.marks.call)  # its fused-attention calls

    def interceptor(self, next_fun, args, kwargs, context):
        """A linen method interceptor, and an NNX one (:func:`jaxamp.nnx_frontend.intercept_calls`,
        whose ``context`` carries the path an NNX module does not know)."""
        module = context.module
        if self.stack and self.stack[-1][0] is module:
            return next_fun(*args, **kwargs)  # a module calling its own methods: same region
        path = getattr(context, "path", None)
        text = module_path(module, path)
        inherited = self.stack[-1][1] if self.stack else self.rules.default
        root = type(self.stack[0][0]).__name__ if self.stack else None
        key = (type(module), text, inherited, root)
        found = self.matches.get(key)
        if found is None:
            found = self.matches[key] = self.rules.match(module, path, inherited, root)
        policy, pattern = found
        if pattern is not None:
            self.matched_patterns.add(pattern)
        self.seen_paths.append(text)
        self.policies.append(policy)
        self.stack.append((module, inherited if policy is None else policy))
        try:
            with self.marks.region(len(self.policies) - 1):
                return next_fun(*args, **kwargs)
        finally:
            self.stack.pop()


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, Tracer))


def _linen_apply_module(fn) -> nn.Module | None:
    module = getattr(fn, "__self__", None)
    if isinstance(module, nn.Module) and getattr(fn, "__name__", "") == "apply":
        return module
    return None


def autocast(fn: Callable, policy: str | jmp.Policy = DEFAULT_POLICY, *,
             overrides: Mapping[Any, str | jmp.Policy] | None = None,
             op_rules: OpRules = DEFAULT_OP_RULES,
             f32_weight_grads: bool | None = None) -> Callable:
    """Returns ``fn`` running under mixed-precision policies, with ``fn``'s signature.

    ``fn`` is any JAX function, typically a Flax linen ``model.apply`` (then module rules
    apply per module) or a loss; or a Flax NNX module (``autocast(model)(x)``), a function
    taking NNX modules (``autocast(f)(model, x)``), or one that merges them from
    ``nnx.split``'s ``(graphdef, state)``: module rules then apply per NNX module, by class or
    by NNX path (``"blocks/3/attn"``). NNX models passed in are not traced into (copies are
    merged inside the trace); Variables the call changes (BatchNorm statistics) are written
    back to them, as calling the model would. Its author writes no dtype code:
    matmuls/convolutions run in the compute dtype; exp/log/softmax/logsumexp, sums and
    normalisation statistics in float32;
    float inputs (params) stay stored in their dtype and are cast where they are used, so
    gradients with respect to them come back in their dtype; integer inputs are never cast.
    The float outputs are cast to the policy's ``output_dtype``.

    Args:
      fn: the function to run.
      policy: the default policy, a string such as ``"params=float32,compute=bfloat16,
        output=float32"`` or a :class:`jmp.Policy`.
      overrides: per-module rules ``{module class or path pattern: policy}``; see
        :mod:`jaxamp.rules` for matching and precedence. Normalisation layers compute in
        float32 unless a rule says otherwise.
      op_rules: which primitives run in which dtype (:data:`jaxamp.DEFAULT_OP_RULES`), and
        which ``jax.custom_vjp`` functions run exactly as traced instead of under the policy
        (``DEFAULT_OP_RULES.extend(custom_vjp_as_traced={"flash_attention"})``; ``"*"``: all).
        Opt a whole module out with a module rule (``overrides={"blocks_*/attn":
        "float32"}``).
      f32_weight_grads: whether a low-precision matmul or convolution with a param operand
        computes that param's gradient with a float32 output (same low-precision operands),
        so that its sum over the batch, across devices too, is float32. None (the default):
        where that sum may cross devices, i.e. when traced under a mesh (``jax.set_mesh``,
        as ``make_train_step(mesh=...)`` does) or when more than one device is visible;
        one device keeps JAX's own transposes.

    Returns:
      A function with ``fn``'s signature; it traces ``fn`` on each call (``jax.jit`` it).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, jaxamp
      >>> model = nn.Dense(4)
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> fwd = jaxamp.autocast(model.apply, "params=float32,compute=float16,output=float32")
      >>> fwd(params, jnp.ones((2, 3))).dtype          # computed in f16, returned in f32
      dtype('float32')
    """
    if not callable(fn):
        raise TypeError(f"autocast: fn must be callable, got {type(fn).__name__}.")
    check_options("autocast", op_rules, f32_weight_grads)
    rules = ModuleRules.create(policy, overrides)
    apply_module = _linen_apply_module(fn)
    if nnx_frontend.is_module(fn):  # autocast(model)(x): model(x), the model passed as an argument
        model = fn

        def fn(*args, **kwargs):
            return args[0](*args[1:], **kwargs)

        functools.update_wrapper(fn, type(model).__call__)
        run = _autocast(fn, rules, op_rules, apply_module, f32_weight_grads)

        @functools.wraps(type(model).__call__)
        def call_model(*args, **kwargs):
            return run(model, *args, **kwargs)

        return call_model
    return functools.wraps(fn)(_autocast(fn, rules, op_rules, apply_module, f32_weight_grads))


def check_options(where: str, op_rules: Any, f32_weight_grads: Any) -> None:
    """Validates autocast's ``op_rules`` and ``f32_weight_grads`` (for the train step too)."""
    if not isinstance(op_rules, OpRules):
        raise TypeError(f"{where}: op_rules must be a jaxamp.OpRules, got "
                        f"{type(op_rules).__name__}. Use jaxamp.DEFAULT_OP_RULES.extend(...).")
    if f32_weight_grads is not None and not isinstance(f32_weight_grads, bool):
        raise TypeError(f"{where}: f32_weight_grads must be True, False or None (decided by "
                        f"the devices), got {f32_weight_grads!r}.")


def _autocast(fn: Callable, rules: ModuleRules, op_rules: OpRules,
              apply_module: nn.Module | None, f32_weight_grads: bool | None) -> Callable:
    def wrapped(*args, **kwargs):
        modules = None
        if any(nnx_frontend.is_module(x) for x in jax.tree_util.tree_leaves(
                (args, kwargs), is_leaf=nnx_frontend.is_module)):
            # NNX models are split: their state is traced, copies are merged inside the trace
            # (the user's objects never hold tracers), and changed values are written back.
            modules = nnx_frontend.ModuleArgs(args, kwargs)
            args, kwargs = modules.split()
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dyn = [i for i, x in enumerate(leaves) if _is_array(x)]
        regions = _Regions(rules)

        def flat_fn(*dyn_vals):
            full = list(leaves)
            for i, x in zip(dyn, dyn_vals):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            with nn.intercept_methods(regions.interceptor), \
                    nnx_frontend.intercept_calls(regions.interceptor), \
                    attention.recording(regions.attention):
                if modules is None:
                    return fn(*a, **k)
                copies, a, k = modules.merge(a, k)
                return fn(*a, **k), modules.values(copies)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
            *[leaves[i] for i in dyn])
        _warn_unmatched(rules, regions)
        sets_matmul = any(getattr(p, "matmul_dtype", None) is not None
                          for p in regions.policies)
        if sets_matmul:
            _warn_no_fp8_rule(regions.policies, op_rules)
        calls = {attention.jit_name(regions.marks.call, i): c
                 for i, c in enumerate(regions.attention.calls)}
        # fp8=delayed keeps a history per layer: repeated and scanned layers in place
        delayed = delayed_active()
        evaluator = Evaluator(regions.policies, op_rules, regions.marks, calls,
                              _sums_across_devices()
                              if f32_weight_grads is None else f32_weight_grads,
                              share=SHARE_REPEATED_CALLS and not delayed,
                              matmul_ends=_matmul_ends(closed.jaxpr) if sets_matmul else None,
                              rules=rule_table(op_rules), layers_in_place=delayed)
        consts = [Value(c, True, not isinstance(c, Tracer), (0,)) for c in closed.consts]
        ins = [Value(leaves[i], True, False, ()) for i in dyn]
        outs = evaluator.eval(closed.jaxpr, consts, ins, (0,))
        _warn_unknown(evaluator.ctx.unknown)
        _warn_float64(evaluator.ctx.float64_matmuls, fn, args, kwargs)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        n_result = len(out_leaves)
        if (apply_module is not None and kwargs.get("mutable")) or modules is not None:
            # linen's updated collections / NNX models' Variables keep their stored dtypes
            n_result = len(jax.tree_util.tree_leaves(out_shape[0]))
        result = []
        for i, (v, shape) in enumerate(zip(outs, out_leaves)):
            if not v.is_float:
                result.append(v.val)
            elif i < n_result:
                result.append(cast(v, rules.default.output_dtype))
            else:
                result.append(cast(v, shape.dtype))  # a collection keeps its stored dtype
        out = jax.tree_util.tree_unflatten(out_tree, result)
        if modules is None:
            return out
        modules.write_back(out[1])
        return out[0]

    return wrapped


def _matmul_ends(jaxpr) -> dict[int, str]:
    """id(eqn) -> ``"first"``/``"last"``: the first and the last ``dot_general`` of the program
    that reads a param (an input, through reshapes/transposes/casts), unless it sits in a loop
    body (it runs once per iteration: every layer of a scanned stack)."""
    dots = param_matmuls(jaxpr, FP8_MATMUL, PARAM_READS)
    ends: dict[int, str] = {}
    if dots and not dots[0][1]:
        ends[id(dots[0][0])] = "first"
    if dots and not dots[-1][1] and dots[-1][0] is not dots[0][0]:
        ends[id(dots[-1][0])] = "last"
    return ends


def _sums_across_devices() -> bool:
    """Whether a batch contraction may be a sum across devices: traced under a mesh
    (``jax.set_mesh``), or more than one device visible (plain ``jax.jit`` of inputs placed
    with ``NamedSharding``, which sets no mesh)."""
    return mesh_is_set() or jax.device_count() > 1


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside jaxamp, JAX, Flax
    and optax: the user's line, however deep the trace that met the problem (a train step's
    ``jit`` included)."""
    mods = (sys.modules["jaxamp"], jax, jmp, sys.modules.get("optax"), sys.modules.get("flax"))
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in mods
                 if m is not None and getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _warn_no_fp8_rule(policies, op_rules: OpRules) -> None:
    fp8 = any(p is not None and getattr(p, "matmul_dtype", None) is not None
              and np.dtype(p.matmul_dtype).itemsize == 1 for p in policies)
    if fp8 and op_rules.handler("dot_general") is None:
        warnings.warn(
            "jaxamp.autocast: a policy sets matmul=float8 but op_rules has no dot_general "
            "handler (the FP8 rule), so every matmul runs in the compute dtype. Build the rules "
            "from jaxamp.DEFAULT_OP_RULES, or add handlers={'dot_general': "
            "jaxamp.FP8Matmuls()}.", stacklevel=_user_stacklevel())


def float64_inputs(fn: Callable, args: tuple, kwargs: Mapping[str, Any] | None = None,
                   ) -> list[str]:
    """The float64 array leaves of ``fn(*args, **kwargs)``, each named by ``fn``'s parameter
    and its path, with its type: ``["batch['x'] (float64[16,8])"]``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature
        params = []
    positional = [p.name for p in itertools.takewhile(
        lambda p: p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD), params)]
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path((tuple(args), dict(kwargs or {}))):
        if not _is_array(leaf) or dtype_of(leaf) != F64:
            continue
        where, key, rest = path[0].idx, path[1], path[2:]
        if where == 1:
            name = key.key
        elif key.idx < len(positional):
            name = positional[key.idx]
        else:
            name = f"args[{key.idx}]"
        found.append(f"{name}{jax.tree_util.keystr(tuple(rest))} "
                     f"(float64[{','.join(map(str, np.shape(leaf)))}])")
    return found


def float64_cause(inputs: list[str]) -> str:
    """Why matmuls ran in float64 and the cast that fixes it (``inputs``:
    :func:`float64_inputs`): the end of autocast's warning and of the audit's finding."""
    if not inputs:
        return ("float64 values the function closes over or makes (a NumPy float64 array or "
                "constant) made them float64, so the policy changes nothing there. Cast them to "
                "float32 where they are made (np.asarray(x, np.float32)).")
    shown = ", ".join(inputs[:4]) + (f" and {len(inputs) - 4} more" if len(inputs) > 4 else "")
    one = len(inputs) == 1
    return (f"the float64 input{'' if one else 's'} {shown} made them float64, so the policy "
            f"changes nothing there. Cast {'it' if one else 'them'} to float32 before the call "
            "(np.asarray(x, np.float32) where the batch is made).")


def _warn_float64(dtypes: set[str], fn: Callable, args: tuple, kwargs: Mapping) -> None:
    if dtypes:
        warnings.warn(
            f"jaxamp.autocast: matmuls ran in float64 where the policy asks for "
            f"{', '.join(sorted(dtypes))}: with jax_enable_x64 on, float64 values are left "
            f"alone (as torch autocast leaves them), and "
            f"{float64_cause(float64_inputs(fn, args, kwargs))}",
            stacklevel=_user_stacklevel())


def _warn_unknown(names: set[str]) -> None:
    if names:
        warnings.warn(
            f"jaxamp.autocast: primitive(s) {sorted(names)} are in no list of the op_rules; "
            "they run exactly as traced (float32). Classify them with "
            "op_rules=jaxamp.DEFAULT_OP_RULES.extend(promote={...}) (or matmul=, fp32=, "
            "structural=, as_traced=) to silence this.", stacklevel=_user_stacklevel())


def _warn_unmatched(rules: ModuleRules, regions: _Regions) -> None:
    paths = list(dict.fromkeys(regions.seen_paths))
    for pattern, _, _ in rules.path_rules:
        if pattern not in regions.matched_patterns:
            near = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.3) or paths[:3]
            hint = (f" The nearest module paths of this model: "
                    f"{', '.join(repr(p) for p in near)}." if near else
                    " The function called no Flax module.")
            warnings.warn(
                f"jaxamp.autocast: path rule {pattern!r} matched no module in this call.{hint} "
                "Paths are the names below the root module joined by '/', the root by its "
                "class name ('*' matches within one segment, '**' across segments); a path "
                "printed by a jaxamp report can be copied as it is.",
                stacklevel=_user_stacklevel())

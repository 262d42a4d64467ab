"""One thread-local, nestable patch manager for what jaxamp intercepts while tracing (NNX
``__call__``, ``jax.nn.dot_product_attention``) that restores only what it installed (model:
qwix ``_src/interception.py``; the rules: ``_engine/README.md``)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any


def _set(owner: Any, name: str, value: Any) -> None:
    # type.__setattr__ on a class: skips a metaclass __setattr__ (nnx's)
    (type.__setattr__ if isinstance(owner, type) else setattr)(owner, name, value)


class Patch:
    """Wraps ``owner.name`` for each ``(owner, name)`` of ``targets()`` (read on every
    activation, so classes defined since are wrapped too) while active. In an active thread
    the wrapper returns ``handler(state, original, *args, **kwargs)``, ``state`` the innermost
    activation's; elsewhere, or while :meth:`paused`, ``original(*args, **kwargs)``."""

    def __init__(self, targets: Callable[[], Iterable[tuple[Any, str]]], handler: Callable):
        self.targets, self.handler = targets, handler
        self._lock = threading.Lock()
        self._local = threading.local()
        self._users = 0  # activations in all threads
        self._wrappers: dict[tuple[Any, str], tuple[Any, Callable]] = {}  # -> (had, ours)

    def stack(self) -> list:
        """This thread's activation states, innermost last."""
        return self._local.__dict__.setdefault("stack", [])

    @contextlib.contextmanager
    def active(self, state: Any):
        """Intercepts this thread's calls with ``state`` until the block ends."""
        with self._lock:
            self._install()
            self._users += 1
        stack = self.stack()
        stack.append(state)
        try:
            yield state
        finally:
            stack.pop()
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._restore()

    @contextlib.contextmanager
    def paused(self):
        """Calls in this thread pass through (a wrapper over ours that calls ours again)."""
        before = getattr(self._local, "paused", False)
        self._local.paused = True
        try:
            yield
        finally:
            self._local.paused = before

    def installed(self) -> bool:
        """Whether one of our wrappers is in place now (for tests)."""
        return any(vars(o).get(name) is ours for (o, name), (_, ours) in self._wrappers.items())

    def _wrap(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            stack = getattr(self._local, "stack", None)
            if not stack or getattr(self._local, "paused", False):
                return original(*args, **kwargs)
            return self.handler(stack[-1], original, *args, **kwargs)

        return wrapper

    def _install(self) -> None:
        """Wraps each target not wrapped by us now; one whose wrapper someone replaced is
        wrapped again, around their function."""
        for owner, name in self.targets():
            now = vars(owner).get(name)
            if self._wrappers.get((owner, name), (None, None))[1] is not now:
                ours = self._wrap(now)
                self._wrappers[owner, name] = (now, ours)
                _set(owner, name, ours)

    def _restore(self) -> None:
        for (owner, name), (had, ours) in self._wrappers.items():
            if vars(owner).get(name) is ours:  # else someone built on it: theirs stays
                _set(owner, name, had)
        self._wrappers.clear()

"""The one patch manager (jaxamp._engine.patching.Patch): per-thread activation, nesting, a
foreign wrapper installed over ours kept on restore, restore after an exception."""

from __future__ import annotations

import threading
import types

import pytest

from jaxamp._engine.patching import Patch


def _target():
    """A module-like owner whose ``f`` doubles, and a Patch that tags calls with its state."""
    owner = types.ModuleType("owner")
    owner.f = lambda x: 2 * x
    seen = []

    def handler(state, original, x):
        seen.append(state)
        return (state, original(x))

    return owner, Patch(lambda: [(owner, "f")], handler), seen


def test_nested_activations_install_once_and_restore_at_the_outermost_exit():
    owner, patch, seen = _target()
    original = owner.f
    with patch.active("outer"):
        wrapper = owner.f
        assert wrapper is not original and patch.installed()
        assert owner.f(3) == ("outer", 6)
        with patch.active("inner"):
            assert owner.f is wrapper  # not wrapped twice
            assert owner.f(3) == ("inner", 6)  # the innermost state
            with patch.paused():
                assert owner.f(3) == 6
            assert owner.f(3) == ("inner", 6)
        assert owner.f is wrapper and owner.f(4) == ("outer", 8)
    assert owner.f is original and not patch.installed()
    assert owner.f(5) == 10 and seen == ["outer", "inner", "inner", "outer"]


def test_other_threads_pass_through_and_each_thread_sees_its_own_state():
    owner, patch, _ = _target()
    original = owner.f
    results: dict = {}
    entered, done = threading.Barrier(3), threading.Barrier(3)

    def active(name):
        with patch.active(name):
            entered.wait()
            results[name] = [owner.f(i) for i in range(50)]
            done.wait()

    def plain():
        entered.wait()
        results["plain"] = [owner.f(i) for i in range(50)]
        done.wait()

    threads = [threading.Thread(target=active, args=("a",)),
               threading.Thread(target=active, args=("b",)), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["a"] == [("a", 2 * i) for i in range(50)]
    assert results["b"] == [("b", 2 * i) for i in range(50)]
    assert results["plain"] == [2 * i for i in range(50)]
    assert owner.f is original and not patch.installed()


def test_a_foreign_wrapper_installed_over_ours_is_kept_and_wrapped_again():
    owner, patch, _ = _target()
    original = owner.f
    with patch.active("outer"):
        ours = owner.f

        def foreign(x):
            return ("foreign", ours(x))

        owner.f = foreign
        assert owner.f(1) == ("foreign", ("outer", 2))
        with patch.active("inner"):  # a new activation wraps their function
            assert owner.f is not foreign and owner.f.__wrapped__ is foreign
            # ours on top records; theirs calls our first wrapper, which is still active
            assert owner.f(1) == ("inner", ("foreign", ("inner", 2)))
        assert owner.f(1) == ("outer", ("foreign", ("outer", 2)))
    assert owner.f is foreign  # theirs stays, only our own wrapper was removed
    assert owner.f(1) == ("foreign", 2)  # and ours below it passes calls through
    owner.f = original


def test_an_exception_restores_and_a_class_attribute_is_patched_on_the_type():
    class Meta(type):
        def __setattr__(cls, name, value):
            raise AssertionError("the manager must not go through a metaclass __setattr__")

    class Model(metaclass=Meta):
        def __call__(self, x):
            return x + 1

    original = Model.__dict__["__call__"]
    patch = Patch(lambda: [(Model, "__call__")],
                  lambda state, fn, self, x: (state, fn(self, x)))
    with pytest.raises(ValueError, match="boom"), patch.active("s"):
        assert Model()(1) == ("s", 2)
        raise ValueError("boom")
    assert Model.__dict__["__call__"] is original and not patch.installed()
    assert patch.stack() == []
    assert Model()(1) == 2

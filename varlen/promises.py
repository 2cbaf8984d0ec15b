"""A promise a plug-in class makes about its own behaviour holds only for the class that declares it.

Some plug-in attributes are promises that let a caller take a shortcut: a policy's
`repeats_decode_batches` (its next decisions are known without asking it), an allocator's
`next_allocation_event` / `grow_decodes` (which of its calls matter, or all of them at once), a cost
model's `decode_step_time` / `step_time_sums` (its time, cheaper), an executor's `decode_run`
(many steps in one call). Each promise is about some behaviour methods. A subclass that overrides
one of them without declaring the promise itself would inherit a promise about code that no
longer runs, and the shortcut would silently skip the override. So a promise is kept only when no
class below the one that declares it (in the MRO) overrides any of its behaviour methods; a
subclass opts back in by declaring the promise in its own body. The interface's own definition
is the safe default every implementation meets (no shortcut, or one derived from the behaviour
itself), not a promise.

Works on mypyc-compiled classes as on Python ones: both have `__mro__` and a `__dict__` that
lists the methods and class attributes the class body defines.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Iterable


class PromiseWarning(UserWarning):
    """A plug-in inherits a promise about behaviour it overrides, so the shortcut is not taken."""


def broken_by(cls: type, promise: str, behaviour: Iterable[str], interface: type) -> str:
    """'' when `cls` keeps `promise`, else why not: '<Class>.<method> overrides ... below <Declarer>'."""
    mro = cls.__mro__
    for i, declarer in enumerate(mro):
        if promise in declarer.__dict__:
            break
    else:
        return ""
    if declarer is interface:
        return ""
    names = tuple(behaviour)
    for c in mro[:i]:
        for name in names:
            if name in c.__dict__:
                return f"{c.__name__}.{name} overrides behaviour that {declarer.__name__}.{promise} promises about"
    return ""


_checked: weakref.WeakKeyDictionary[type, dict[tuple[str, ...], str]] = weakref.WeakKeyDictionary()


def keeps_promise(obj: object, promises: str | tuple[str, ...], behaviour: Iterable[str], interface: type) -> bool:
    """Whether `obj`'s class keeps each of `promises` (see the module doc). Decided once per class;
    a broken one is said once, as a PromiseWarning naming the class and the override."""
    cls = type(obj)
    names = (promises,) if isinstance(promises, str) else tuple(promises)
    seen = _checked.setdefault(cls, {})
    why = seen.get(names)
    if why is None:
        why = ""
        for promise in names:
            why = broken_by(cls, promise, behaviour, interface)
            if why:
                name = cls.__name__
                why += (f"; the promise is not {name}'s, so its shortcut is not taken (steps run one at a time: "
                        f"same results, slower). If {name} keeps it, declare {promise} in {name} itself.")
                warnings.warn(f"{cls.__module__}.{cls.__qualname__}: {why}", PromiseWarning, stacklevel=3)
                break
        seen[names] = why
    return not why

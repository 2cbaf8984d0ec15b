"""A promise a plug-in class makes about its own behaviour holds only for the class that declares it.

Promises (e.g. a policy's `repeats_decode_batches`, an executor's `decode_run`) let a caller skip
behaviour methods; when a subclass overrides one without re-declaring the promise, the promise
lapses (else the override would be silently skipped). Works on mypyc classes too.
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
    """Whether `obj`'s class keeps each of `promises`; decided once per class, a broken one warned once."""
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

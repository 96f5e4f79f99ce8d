"""State-dict keys named in options: which name matched nothing, and the key it likely meant.

``allow_missing={"lm_head"}`` when the key is ``lm_head.weight`` allows nothing; the load is
then refused for the missing key, and the refusal should say why the option did not help.
No torch here.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable

__all__ = ["closest_key", "did_you_mean"]


def closest_key(name: str, keys: Iterable[str]) -> str | None:
    """The key ``name`` most likely meant, or ``None`` when none is close.

    Args:
        name: What was given.
        keys: The keys, the likeliest first (a load passes its missing keys first).

    Returns:
        The first key that ``name`` is a dotted prefix or suffix of (``lm_head`` for
        ``lm_head.weight``, ``embed_tokens.weight`` for ``model.embed_tokens.weight``),
        else the most similar by :func:`difflib.get_close_matches`, else ``None``.
    """
    candidates = list(dict.fromkeys(keys))
    for key in candidates:
        if key.startswith(name + ".") or key.endswith("." + name):
            return key
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(unmatched: Collection[str], keys: Iterable[str], *, option: str) -> str:
    """A clause naming the ``option`` entries that matched no key, each with its closest
    key; ``""`` when every entry matched.

    Args:
        unmatched: The option's entries that match no key, in the order to name them.
        keys: The keys to suggest from (the ones the option was probably meant for first).
        option: The option's name, e.g. ``"allow_missing"``.
    """
    if not unmatched:
        return ""
    pool = list(keys)
    parts = []
    for name in unmatched:
        near = closest_key(name, pool)
        parts.append(f"{name!r}" + (f" (did you mean {near!r}?)" if near else ""))
    verb = "matches" if len(parts) == 1 else "match"
    return f"; {option} names {', '.join(parts)}, which {verb} no key"

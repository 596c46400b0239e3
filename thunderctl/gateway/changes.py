"""Which entries of a large store changed since someone last asked: what lets the daemon's journal
write a store of tens of thousands of entries by its changes, not whole at every tick."""

from __future__ import annotations


class ChangedKeys:
    """The keys added, changed or removed since the last `take`; none are kept before `follow` (a
    store nobody journals keeps no record of its changes)."""

    def __init__(self) -> None:
        self._keys: set[str] | None = None

    def follow(self) -> None:
        if self._keys is None:
            self._keys = set()

    def mark(self, key: str) -> None:
        if self._keys is not None:
            self._keys.add(key)

    def take(self) -> set[str]:
        """The keys changed since the last take (or `follow`), forgotten here from now."""
        keys, self._keys = self._keys or set(), set() if self._keys is not None else None
        return keys

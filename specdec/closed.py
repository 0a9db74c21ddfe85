"""The one record of requests closed lately, which every place that closes requests keeps (the target's
scheduler, a draft replica, its draft loop): a close may come before its request does (a caller that gave
up while its open or generate call was on the way), and the request is then refused when it arrives, so
that no row outlives its caller. Bounded: a close that raced a request's own end would otherwise be kept
forever."""

KEPT = 4096


class RecentlyClosed:
    """The most recent `kept` request ids closed, oldest first. Not locked: its owner's lock guards it."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._ids: dict[str, None] = {}  # insertion-ordered: the oldest is forgotten first

    def add(self, rid: str) -> None:
        self._ids.pop(rid, None)
        self._ids[rid] = None
        if len(self._ids) > self.kept:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids

    def take(self, rid: str) -> bool:
        """Whether `rid` was closed; it is forgotten here (its request is refused once)."""
        return self._ids.pop(rid, 0) is None

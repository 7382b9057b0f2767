"""expert_cache = auto on a GPU: how many expert slots a card has room for once everything else it needs is in place
(CupyCard.fit_pool measures the numbers; this is the arithmetic, apart so that the sharing of one GPU by several lanes
is tested without one)."""
from __future__ import annotations


def room_slots(free: int, needs: int, reserve: int, before: int, after: int, slot_bytes: int, most: int) -> int:
    """Slots for a card whose GPU has `free` bytes free now that the card holds all but its pool (`needs` of them,
    reserve: what it keeps free for later growth and margin). `before` lanes of this GPU built earlier and keep
    their reserves free too (free counts them); each of the `after` lanes still to build is left its needs, its
    reserve and an equal share of the rest. At most `most`, at least 0."""
    room = (free - (before + 1) * reserve - after * (needs + reserve)) // (after + 1)
    return int(max(0, min(most, room // slot_bytes)))


def packing_costs_no_slot(extra: int, free: int, needs: int, reserve: int, before: int, after: int, slot_bytes: int,
                          most: int) -> bool:
    """Whether a card may take `extra` bytes beside its pool (its layers packed: [gpu] pack_layers) and still get
    the slots it would without them, room_slots' arguments otherwise (each lane still to build takes the extra
    too)."""
    return bool(extra) and room_slots(free - extra, needs + extra, reserve, before, after, slot_bytes, most) == \
        room_slots(free, needs, reserve, before, after, slot_bytes, most)

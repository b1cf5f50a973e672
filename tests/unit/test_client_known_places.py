"""client/known_places.py's bookkeeping: where plain values were last seen, per master incarnation."""

from __future__ import annotations

from kvpool.client.known_places import KnownPlaces
from kvpool.core.protocol import Replica


def test_a_place_is_given_back_only_under_the_incarnation_that_placed_it():
    places = KnownPlaces()
    places.note("a", [Replica(1, 0, 4096), Replica(2, 8192, 4096)], epoch=7)
    place = places.get("a", 7)
    assert place is not None and place.size == 4096 and place.replicas[1] == Replica(2, 8192, 4096)
    assert places.get("a", 8) is None  # a new master: the place is dropped...
    assert places.get("a", 7) is None  # ...for good
    places.note("b", [Replica(1, 0, 10)], epoch=None)  # no incarnation heard yet: nothing noted
    places.note("c", [], epoch=7)
    assert len(places) == 0


def test_the_least_recently_used_places_go_first_and_forget_drops_keys():
    places = KnownPlaces(max_places=3)
    for i, key in enumerate("abc"):
        places.note(key, [Replica(1, i * 100, 100)], epoch=1)
    assert places.get("a", 1) is not None  # "a" used: "b" is now the oldest
    places.note("d", [Replica(1, 300, 100)], epoch=1)
    assert places.get("b", 1) is None and len(places) == 3
    places.note("a", [Replica(2, 0, 100)], epoch=1)  # seen elsewhere: the newer place wins
    assert places.get("a", 1).replicas == (Replica(2, 0, 100),)
    places.forget(["a", "zz"])
    assert places.get("a", 1) is None and places.get("c", 1) is not None
    places.clear()
    assert len(places) == 0

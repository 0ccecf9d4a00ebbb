"""The stop-string automaton against a brute-force search, and its work per character."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpage.core.stop_matcher import ROOT, StopAutomaton, StopMatcher, automaton_for


def first_hit(text, stops):
    """Where the earliest stop string in text begins, by searching for each."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def held_length(text, stops):
    """Longest suffix of text that is a proper prefix of a stop string, by trying each."""
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:n])), default=0)


# A tiny alphabet makes overlapping and nested stop strings ("ab", "bab",
# "b") and partial matches common.
stop_lists = st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=6)
# Each edit cuts up to 3 characters off the tail, then appends some.
edits = st.lists(st.tuples(st.integers(0, 3), st.text("abcd", max_size=6)), max_size=12)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stop_lists, edits)
def test_matches_a_brute_force_search_as_the_text_grows_and_its_tail_changes(stops, edits):
    matcher = StopMatcher(StopAutomaton(stops))
    text = ""
    for cut, added in edits:
        text = text[: len(text) - cut] + added
        scan = matcher.scan(text)
        assert scan.hit == first_hit(text, stops)
        if scan.hit is not None:
            break  # the detokenizer stops here
        matcher.move(scan)
        assert matcher.held == held_length(text, stops)


def test_the_earliest_start_wins_over_the_earliest_end():
    # "bc" ends first, but "abcd" ends in the same new text and starts earlier.
    matcher = StopMatcher(StopAutomaton(["bc", "abcd"]))
    assert matcher.scan("xabcd").hit == 1
    assert matcher.scan("xabc").hit == 2


def test_a_scan_does_not_move_the_matcher():
    matcher = StopMatcher(StopAutomaton(["STOP"]))
    matcher.move(matcher.scan("go ST"))
    assert matcher.held == 2
    assert matcher.scan("go STOP").hit == 3
    assert (matcher.text, matcher.held) == ("go ST", 2)
    assert matcher.scan("go STAR").hit is None


def test_a_stop_string_inside_another_is_found_through_failure_links():
    automaton = StopAutomaton(["abc", "b"])
    # states: root, "a", "ab", "abc", "b"
    assert automaton.depth == [0, 1, 2, 3, 1]
    assert automaton.fail == [ROOT, ROOT, 4, ROOT, ROOT]  # "ab" falls back to "b"
    assert automaton.match == [0, 0, 1, 3, 1]  # "ab" ends with the stop string "b"
    assert StopMatcher(automaton).scan("xab").hit == 2


def test_transitions_per_character_do_not_grow_with_the_number_of_stop_strings():
    """Each character costs one transition plus failure links, and the
    failure links taken never exceed the characters fed: at most two per
    character, for ten stop strings or ten thousand."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(2, 12)))
             for _ in range(10_000)]
    text = "".join(rng.choice("abcdefgh ") for _ in range(3000))
    work = {}
    for count in (10, 10_000):
        stops = [w + "#" for w in words[:count]]  # '#' never comes: the text is never cut
        matcher = StopMatcher(StopAutomaton(stops))
        for end in range(0, len(text) + 1, 7):  # seven new characters a step
            before = matcher.transitions
            scan = matcher.scan(text[:end])
            assert scan.hit is None
            matcher.move(scan)
            # a step's failure links are bounded by the depth it started at
            assert matcher.transitions - before <= 7 + 12 + 7
        work[count] = matcher.transitions
    assert work[10] <= 2 * len(text) and work[10_000] <= 2 * len(text)
    assert work[10_000] > len(text)  # it did follow failure links


def test_automata_are_shared_by_equal_stop_lists():
    assert automaton_for(("a", "b")) is automaton_for(("a", "b"))

"""Stop-string matching whose work per step does not grow with the number of
stop strings: an Aho–Corasick automaton over them, fed only the characters a
step added to the text.

One automaton serves every sequence with the same stop strings; each sequence
keeps a `StopMatcher`, the automaton's state after the text seen so far. The
state answers both questions the detokenizer asks each step: where the
earliest stop string in the new text starts, and how much of the text's tail
may still become one (the state's depth, held back until decided).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

ROOT = 0  # the automaton's start state: the empty string
# Automata kept for reuse: the samples of one request, and requests that send
# the same stop strings (a chat template's), build theirs once.
CACHED_AUTOMATA = 32


class StopAutomaton:
    """The trie of the stop strings with failure links. Immutable.

    A state is a trie node: a prefix of some stop string. After a text, the
    state is the longest suffix of the text that is such a prefix.
    """

    __slots__ = ("children", "fail", "depth", "match", "alphabet", "max_length")

    def __init__(self, stops: Sequence[str]) -> None:
        assert stops and all(stops), "stop strings must be given and not empty"
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]  # length of the state's string
        ends = [False]  # the state's string is a stop string
        for stop in stops:
            node = ROOT
            for char in stop:
                child = self.children[node].get(char)
                if child is None:
                    child = len(self.children)
                    self.children[node][char] = child
                    self.children.append({})
                    self.depth.append(self.depth[node] + 1)
                    ends.append(False)
                node = child
            ends[node] = True
        self.alphabet = frozenset(char for stop in stops for char in stop)
        self.max_length = max(map(len, stops))
        # fail: the state of the longest proper suffix of the state's string.
        # match: length of the longest stop string ending the state's string
        # (0: none), so the earliest-starting hit at a position is one lookup.
        self.fail = [ROOT] * len(self.children)
        self.match = [0] * len(self.children)
        queue = deque([ROOT])  # breadth first: a failure link is shallower, so done first
        while queue:
            node = queue.popleft()
            for char, child in self.children[node].items():
                if node != ROOT:
                    self.fail[child] = self.step(self.fail[node], char)[0]
                inherited = self.match[self.fail[child]]
                self.match[child] = self.depth[child] if ends[child] else inherited
                queue.append(child)

    def step(self, node: int, char: str) -> tuple[int, int]:
        """The state after char, and the number of transitions taken to find it."""
        if char not in self.alphabet:  # most output characters are in no stop string
            return ROOT, 1
        moves = 1
        while (child := self.children[node].get(char)) is None:
            if node == ROOT:
                return ROOT, moves
            node = self.fail[node]
            moves += 1
        return child, moves


@functools.lru_cache(maxsize=CACHED_AUTOMATA)
def automaton_for(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class Scan(NamedTuple):
    """What a text looks like to the automaton; see `StopMatcher.scan`."""

    text: str
    node: int  # the state after the whole text
    hit: int | None  # where the earliest stop string ending in the new text starts


class StopMatcher:
    """One sequence's position in a `StopAutomaton`, over a text that grows
    at its tail. Nothing is matched in text the matcher was moved past."""

    def __init__(self, automaton: StopAutomaton) -> None:
        self.automaton = automaton
        self.text = ""  # the text `node` is the state after
        self.node = ROOT
        self.transitions = 0  # automaton transitions taken so far: the matcher's work

    @property
    def held(self) -> int:
        """Length of the longest suffix of the text that is a prefix of a stop
        string: a proper prefix, unless a stop string ends the text."""
        return self.automaton.depth[self.node]

    def scan(self, text: str) -> Scan:
        """Match text's new characters (those past what it shares with the
        matcher's text) without moving the matcher; see `move`."""
        automaton = self.automaton
        same = _shared_prefix_length(self.text, text)
        node = self.node
        if same < len(self.text):
            # The tail changed. No state is deeper than the longest stop
            # string, so restarting that far back is exact again at `same`;
            # nothing ends there that was not seen before.
            node = ROOT
            for char in text[max(0, same - automaton.max_length) : same]:
                node, moves = automaton.step(node, char)
                self.transitions += moves
        hit = None
        for end in range(same + 1, len(text) + 1):
            node, moves = automaton.step(node, text[end - 1])
            self.transitions += moves
            if length := automaton.match[node]:
                # A longer stop string ending later may still start earlier.
                hit = end - length if hit is None else min(hit, end - length)
        return Scan(text, node, hit)

    def move(self, scan: Scan) -> None:
        """Take a scan's text as the matcher's text."""
        self.text, self.node = scan.text, scan.node


def _shared_prefix_length(old: str, new: str) -> int:
    if new.startswith(old):  # the usual case: text was only added
        return len(old)
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return i
    return len(new)  # new is a prefix of old

"""Which corpus table (core/corpus.py) the `corpus` proposer reads.

engine.spec_corpus "auto" takes the table that ships for the target's
vocabulary, if one does (`PACKAGED_TABLES`, inside the package as the
drafts are; the target's tokenizer fingerprint must match), and otherwise
leaves the method off; a path takes that file, which must hold a table of
the target's vocabulary; "" takes none.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
from pathlib import Path
from typing import Any

from specpage.core.corpus import CorpusTable, CorpusTableError, vocabulary_fingerprint

log = logging.getLogger("specpage.models")

# tables inside the specpage package (specpage/drafts/NAME links to models/NAME)
PACKAGED_TABLES = ("drafts/smollm2-corpus/table.bin",)


def packaged_tables() -> list[Path]:
    root = Path(str(importlib.resources.files("specpage")))
    return [root / name for name in PACKAGED_TABLES if (root / name).is_file()]


def corpus_table(setting: str, tokenizer: Any) -> CorpusTable | None:
    """The table engine.spec_corpus names for a target with this tokenizer
    (None: no table; the corpus method is then off)."""
    if not setting:
        return None
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        if setting == "auto":
            return None
        raise CorpusTableError(f"engine.spec_corpus {setting}: the target has no tokenizer "
                               "to check the table's vocabulary against")
    fingerprint = vocabulary_fingerprint(tokenizer)
    if setting != "auto":
        path = Path(setting).expanduser()
        theirs = CorpusTable.fingerprint_of(path)
        if theirs != fingerprint:
            raise CorpusTableError(
                f"engine.spec_corpus {setting}: a table of another vocabulary "
                f"({theirs[:12]}), not the target's ({fingerprint[:12]})")
        return _loaded(path.resolve(), path.stat().st_mtime_ns)
    for path in packaged_tables():
        if CorpusTable.fingerprint_of(path) == fingerprint:
            table = _loaded(path.resolve(), path.stat().st_mtime_ns)
            log.info("corpus table: %s (%d n-grams of %d tokens)", path, table.num_entries,
                     table.tokens)
            return table
    return None


@functools.lru_cache(maxsize=4)
def _loaded(path: Path, mtime_ns: int) -> CorpusTable:
    """A table file's contents, read once per process (engines only read
    them) and again once the file changes."""
    return CorpusTable.load(path)

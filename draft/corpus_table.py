"""Count the `corpus` proposer's table (specpage/core/corpus.py) over the
target's own answers: the JSONL shards draft/generate_data.py writes
(gzipped or not), each answer after the last 3 tokens of its prompt.

    python -m draft.corpus_table --data draft/snapshots --out models/smollm2-corpus/table.bin
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from specpage.core.corpus import N_MAX, CorpusTable, vocabulary_fingerprint
from specpage.engine.builder import ModelChoice, load_models


def answers(folder: Path) -> Iterator[tuple[list[int], int]]:
    """(the prompt's last N_MAX tokens and the answer, N_MAX) per answer."""
    for path in sorted(folder.glob("answers-*.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as lines:
            for line in lines:
                record = json.loads(line)
                context = record["prompt"][-N_MAX:]
                yield context + record["output"], len(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("draft/snapshots"))
    parser.add_argument("--out", type=Path, default=Path("models/smollm2-corpus/table.bin"))
    parser.add_argument("--model", default="smollm2-135m",
                        help="whose tokenizer the answers use: a name, folder or GGUF, "
                        "as `specpage serve --model` takes it")
    args = parser.parse_args()
    # the tokenizer the engine itself would read for that target
    tokenizer = load_models(ModelChoice(args.model)).tokenizer
    table = CorpusTable.count(answers(args.data), vocabulary_fingerprint(tokenizer))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.save(args.out)
    print(json.dumps({"tokens": table.tokens, "entries": [len(t) for t in table.tables],
                      "bytes": args.out.stat().st_size, "out": str(args.out)}))


if __name__ == "__main__":
    main()

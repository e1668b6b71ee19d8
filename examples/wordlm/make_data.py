"""Write data/{train,valid,test}.txt, the word-level language model's corpus, in
wikitext's layout (one paragraph a line, words separated by spaces): the English
text of Python's own reference topics (`pydoc_data`, in every Python), cut into
paragraphs, shuffled once with a fixed seed and split 80/10/10.

    python examples/wordlm/make_data.py [DIR]     # writes examples/wordlm/data/ (or DIR)

With wikitext-2 (or your own corpus) in that layout, point train.data_dir at it instead.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from pydoc_data.topics import topics

OUT = Path(__file__).resolve().parent / "data"
SEED = 0


def paragraphs() -> list[str]:
    """Every paragraph of the topics, lowercased, words and punctuation split by spaces."""
    out = []
    for text in topics.values():
        for block in re.split(r"\n\s*\n", text):
            words = re.findall(r"[a-z0-9_]+|[^\sa-z0-9_]", block.lower())
            if len(words) >= 8:
                out.append(" ".join(words))
    return out


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    lines = paragraphs()
    random.Random(SEED).shuffle(lines)
    cut1, cut2 = round(len(lines) * 0.8), round(len(lines) * 0.9)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", lines[:cut1]), ("valid", lines[cut1:cut2]), ("test", lines[cut2:])):
        (out / f"{name}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")
        print(f"wrote {out / name}.txt: {len(part)} paragraphs, {sum(len(p.split()) for p in part)} words")


if __name__ == "__main__":
    main()

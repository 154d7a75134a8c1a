"""Writes a long-context prompt: an Austen passage followed by a question about it.

    python examples/austen_prompt.py --words 4500 > prompt.txt   # ~6K SmolLM2 tokens
"""

import argparse

from oasiskv.data.austen import NOVELS, austen_text

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--novel", default="prideprejudice", choices=NOVELS)
parser.add_argument("--words", type=int, default=4500, help="passage length in words")
parser.add_argument("--question", default="Summarise what happens in this passage in three "
                    "sentences, naming the characters involved.")
args = parser.parse_args()

words = austen_text(args.novel).split(" ")
passage = " ".join(words[: args.words])
print(f"Read this passage from a novel by Jane Austen.\n\n{passage}\n\n{args.question}")

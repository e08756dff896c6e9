"""Write the demo and test text corpus: the King James Version of the Bible, as plain UTF-8 text.

    python3 scripts/corpus_kjv.py data/kjv.txt
    python -m trainer_pkg.prepare_text data/kjv.txt --out data/kjv-tokens --vocab-size 4096

The text comes from Debian's ``bible-kjv`` package (its ``bible`` program and the ``bible-kjv-text``
data, installed by ``scripts/system-deps.sh``): 31,102 verses, 4.1 MB, 1,036,566 tokens with a
4,096-token BPE. The translation (1611) is in the public domain (see
/usr/share/doc/bible-kjv-text/copyright: "The copyright for the King James Version text of the Bible
is expired"); the package's retrieval program is GPL-2+, and only its output is used here.

One verse per line without its reference ("Ge1:1 "), a blank line between books; the folder of
OUT.txt is made when missing. Nothing is downloaded; exit 2 when the ``bible`` program is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

BIBLE = "bible"
_REFERENCE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) ")


def kjv_lines() -> list[str]:
    """Every verse, Genesis 1:1 to Revelation 22:21, each without its reference; "" between books."""
    program = shutil.which(BIBLE) or "/usr/bin/bible"
    # -f turns pretty-printing off: one verse per line, each led by its reference.
    out = subprocess.run([program, "-f", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    lines, book = [], None
    for line in out.splitlines():
        m = _REFERENCE.match(line)
        if not m:
            continue
        if book is not None and m.group(1) != book:
            lines.append("")
        book = m.group(1)
        lines.append(line[m.end():].strip())
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 scripts/corpus_kjv.py OUT.txt", file=sys.stderr)
        return 2
    if not (shutil.which(BIBLE) or os.path.exists("/usr/bin/bible")):
        print("corpus_kjv: the bible program is missing: apt-get install bible-kjv (scripts/system-deps.sh does)",
              file=sys.stderr)
        return 2
    lines = kjv_lines()
    # The README's command writes data/kjv.txt, and a fresh clone has no data/ (it is .gitignored).
    os.makedirs(os.path.dirname(os.path.abspath(argv[0])), exist_ok=True)
    with open(argv[0], "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"corpus_kjv: wrote {argv[0]}: {sum(1 for x in lines if x):,} verses", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Every measured figure in README.md and docs/ comes from a results file.

A figure is a number with a unit of time, size, ratio or share (``41.2 ms``,
``7.0 MB``, ``9.7x``, ``85.68%``, both ends of ``41-57 ms``) anywhere in the
text, or a decimal, grouped or three-digit number (``1405.9``, ``37,991``) in a
table row or in a code block's output (not its command lines). Each must appear, written the
same way (digits as shown, thousands separators optional), as a number in some
file under ``docs/results/``: the files the commands next to the figures wrote.
A hand-made ratio, a rounded-off value or a figure of a run nobody kept fails.

Constants that no run produces (link rates, buffer sizes, limits the library
sets) are in ``CONSTANTS`` below with the reason they are not measurements.

Runs without the library or torch: ``python3 tests/test_docs_figures.py``
lists every unsupported figure with its file and line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "docs" / "results"

_UNITS = r"ms|s|µs|us|ns|MB|GB|KB|kB|MiB|GiB|KiB|TB|B|bytes|x|%|GB/s|MB/s|minutes|min"
_NUMBER = r"(\d[\d,]*(?:\.\d+)?)"
#: a number followed by a unit (not a link rate: ``Mbit/s`` is a setting), or a
#: range of two (``41-57 ms``, ``2.3 to 2.8x``): both ends are figures
FIGURE = re.compile(
    r"(?<![\w.\-/])"
    + _NUMBER
    + r"(?:\s?(?:-|–|to)\s?"
    + _NUMBER
    + r")?\s?(?:"
    + _UNITS
    + r")(?![\w/])"
)
#: in a table row: a decimal, a grouped number or a number of three or more digits
TABLE_NUMBER = re.compile(r"(?<![\w.\-/,])(\d+\.\d+|\d{1,3}(?:,\d{3})+|\d{3,})(?![\w.%/,])")
#: in a code block, a line of a command or code (its numbers are arguments, not
#: output): the rest of a code block is a run's output, checked like a table
_COMMAND = re.compile(
    r"\s*(\$|\.venv|sparcml|python|make|sudo|torchrun|mpirun|[A-Z_]+=)|.*(=|\(|--)"
)
_RESULT_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")

#: fenced blocks in these languages hold source, whose numbers are settings
SOURCE_LANGUAGES = {"python", "py", "yaml", "yml", "json", "toml"}

#: figures that are settings or definitions, not results of a run
CONSTANTS: dict[str, str] = {
    "64 MB": "the hostmem buffer size the library allocates",
    "1.5x": "autotune's documented re-measure threshold",
}


def _result_numbers() -> set[str]:
    out: set[str] = set()
    for p in RESULTS.rglob("*"):
        if not p.is_file() or p.suffix in {".png", ".pdf", ".pt", ".npz"}:
            continue
        for m in _RESULT_NUMBER.finditer(p.read_text(errors="ignore")):
            s = m.group()
            out.add(s)
            out.add(s.replace(",", ""))
    return out


def unsupported_figures() -> list[tuple[str, int, str]]:
    """(file, line, figure) for each figure no results file holds."""
    known = _result_numbers()
    out: list[tuple[str, int, str]] = []
    for doc in DOCS:
        in_code = False
        source = False  # a fenced block of source (```python, ```yaml, ...): no output
        for no, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
                source = in_code and line.strip()[3:].strip() in SOURCE_LANGUAGES
                continue
            found = [(m.group(0), n) for m in FIGURE.finditer(line) for n in m.groups() if n]
            output = in_code and not source and not _COMMAND.match(line)
            if line.lstrip().startswith("|") or output:
                found += [(m.group(1), m.group(1)) for m in TABLE_NUMBER.finditer(line)]
            for figure, number in found:
                if figure in CONSTANTS or number in known or number.replace(",", "") in known:
                    continue
                out.append((str(doc.relative_to(ROOT)), no, figure))
    return out


def test_every_documented_figure_comes_from_a_results_file() -> None:
    missing = unsupported_figures()
    listing = "\n".join(f"{f}:{n}: {fig}" for f, n, fig in missing)
    assert not missing, f"{len(missing)} figures with no results file behind them:\n{listing}"


def test_the_check_catches_a_figure_with_no_run_behind_it(tmp_path: Path) -> None:
    known = _result_numbers()
    assert "240.7" not in known  # TopK.select's old time, from no kept run
    line = "| TopK.select | 240.7 ms | 39.4 | 41-57 ms |"
    figures = [n for m in FIGURE.finditer(line) for n in m.groups() if n]
    figures += [m.group(1) for m in TABLE_NUMBER.finditer(line)]
    assert {"240.7", "39.4", "41", "57"} <= set(figures)


def test_constants_are_still_used() -> None:
    text = "\n".join(d.read_text() for d in DOCS)
    assert [c for c in CONSTANTS if c not in text] == []


if __name__ == "__main__":
    rows = unsupported_figures()
    for f, n, fig in rows:
        print(f"{f}:{n}: {fig}")
    print(f"{len(rows)} unsupported figures", file=sys.stderr)
    sys.exit(1 if rows else 0)

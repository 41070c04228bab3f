"""Copies the benchmark results (written by the benchmark scripts) into README.md.

    python benchmarks/update_readme.py

README.md holds blocks delimited by ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->``; each is replaced by ``benchmarks/results/NAME.md``
(as the benchmark wrote it, command and machine included) and its plot. No
number in those blocks is typed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _block(name: str) -> str:
  md = RESULTS / f"{name}.md"
  if not md.exists():
    return (f"_Not generated yet: run the benchmark that writes `benchmarks/results/{name}.md`._")
  text = md.read_text().strip()
  # Demote the file's headings so they nest under the README's section.
  text = re.sub(r"^(#+) ", lambda m: "#" * min(len(m.group(1)) + 3, 6) + " ", text, flags=re.M)
  # Relative links in the results file point into benchmarks/results/.
  text = re.sub(r"\]\((?!https?:|/|benchmarks/)([^)]+)\)", r"](benchmarks/results/\1)", text)
  png = RESULTS / f"{name}.png"
  plot = (f"\n\n![{name}](benchmarks/results/{name}.png)"
          if png.exists() and f"results/{name}.png" not in text else "")
  return (f"<details><summary>benchmarks/results/{name}.md (generated)</summary>\n\n"
          f"{text}\n\n</details>{plot}")


def main() -> int:
  readme = ROOT / "README.md"
  text = readme.read_text()
  names = re.findall(r"<!-- results:([\w.-]+) -->", text)
  for name in names:
    pattern = re.compile(
        rf"(<!-- results:{re.escape(name)} -->).*?(<!-- /results:{re.escape(name)} -->)", re.S)
    text = pattern.sub(lambda m: m.group(1) + "\n" + _block(name) + "\n" + m.group(2), text)
  readme.write_text(text)
  print(f"updated {len(names)} result blocks in README.md: {', '.join(names)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""The docs site reads offline and links what it names.

The tests of the built site read ``docs/_build/html``: they skip when it was not built
(``python3 dev.py docs``), and fail instead when ``ONEBIT_DOCS_BUILT=1`` (CI's docs step
sets it and runs this file right after building).
"""

from __future__ import annotations

import html.parser
import os
import re
import sys
from pathlib import Path

import pytest

import onebit_optax

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
sys.path.insert(0, str(ROOT / "docs" / "_inventories"))
import make_inventories  # noqa: E402  pylint: disable=wrong-import-position
import onebit_docs  # noqa: E402  pylint: disable=wrong-import-position

# The pages a newcomer reads: every API name they show in code links to its entry.
GUIDES = ("index.html", "getting_started.html", "guides/*.html", "how_it_works/*.html")


def _site() -> Path:
  """The built site, current with the sources; else a skip (or a failure in CI)."""
  stamp = SITE / "searchindex.js"  # written by every build
  sources = [p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts]
  why = None
  if not stamp.exists():
    why = "the docs are not built: run `python3 dev.py docs` first"
  elif max(p.stat().st_mtime for p in sources) > stamp.stat().st_mtime:
    why = "the built docs are older than their sources: rerun `python3 dev.py docs`"
  if why and os.environ.get("ONEBIT_DOCS_BUILT") == "1":
    pytest.fail(why + " (ONEBIT_DOCS_BUILT=1 says they were just built)")
  if why:
    pytest.skip(why)
  return SITE


def _without_scripts(text: str) -> str:
  return re.sub(r"<script\b.*?</script>", "", text, flags=re.S)


def test_algorithm_page_shows_rendered_math():
  page = _without_scripts((_site() / "how_it_works" / "algorithm.html").read_text())
  assert len(re.findall(r"<math\b", page)) >= 10, "no MathML: is the mathml renderer on?"
  for raw in (r"\(", r"\[", "$$"):
    assert raw not in page, f"raw TeX {raw!r} left for a script to typeset"
  # Each math element of the page holds MathML (none fell back to its TeX source).
  after = [page[m.end():m.end() + 300] for m in re.finditer(r'class="math notranslate"', page)]
  fell_back = [a[:80] for a in after if not re.match(r'[^>]*>\s*(<span class="eqno">.*?</span>)?<math', a, flags=re.S)]
  assert after and not fell_back, fell_back


def test_no_page_loads_anything_from_the_network():
  remote = re.compile(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"')
  for path in _site().rglob("*.html"):
    found = remote.findall(path.read_text())
    assert not found, (path.relative_to(SITE), found[:3])


class _CodeText(html.parser.HTMLParser):
  """The text inside ``<code>`` outside headings, each piece with whether a link holds it."""

  def __init__(self):
    super().__init__()
    self.depth = {"a": 0, "code": 0, "heading": 0}
    self.pieces: list[tuple[str, bool]] = []
    self.stack: list[str] = []

  def _tag(self, tag: str) -> str | None:
    return "heading" if re.fullmatch(r"h[1-6]", tag) else tag if tag in self.depth else None

  def handle_starttag(self, tag, attrs):
    if tag == "code" and "field" in (dict(attrs).get("class") or "").split():
      tag = "heading"  # a field's name ({.field}), not the function of that name: not counted
    if self._tag(tag):
      self.depth[self._tag(tag)] += 1
    self.stack.append(tag)

  def handle_endtag(self, tag):
    while self.stack:  # closes what the start tag opened (a field's code counted as a heading)
      opened = self.stack.pop()
      if self._tag(opened):
        self.depth[self._tag(opened)] -= 1
      if opened == tag or (opened == "heading" and tag == "code"):
        break

  def handle_data(self, data):
    if self.depth["code"] and not self.depth["heading"]:
      self.pieces.append((data, self.depth["a"] > 0))


def api_mentions(page: Path) -> tuple[int, list[str]]:
  """How many API names the page's inline code shows linked, and the ones not linked."""
  parser = _CodeText()
  parser.feed(re.sub(r"<pre\b.*?</pre>", "", _without_scripts(page.read_text()), flags=re.S))
  public = frozenset(onebit_optax.__all__)
  external = onebit_docs._external_names()  # pylint: disable=protected-access
  linked, unlinked = 0, []
  for text, in_link in parser.pieces:
    for start, end, _ in onebit_docs.code_links(text, public, external):
      if in_link:
        linked += 1
      else:
        unlinked.append(text[start:end])
  return linked, unlinked


def test_guides_link_every_api_name_they_show():
  site = _site()
  pages = [p for pattern in GUIDES for p in sorted(site.glob(pattern))]
  assert len(pages) > 10, pages
  linked, unlinked = 0, {}
  for page in pages:
    n, missing = api_mentions(page)
    linked += n
    if missing:
      unlinked[str(page.relative_to(site))] = missing
  assert not unlinked, f"API names shown as code without a link: {unlinked}"
  assert linked > 150, linked  # the guides name the API often: the count is not vacuous


def test_learning_rate_reads_as_optax_scalar_or_schedule():
  for name in ("onebit_adam", "zero_one_adam", "scale_by_zero_one_adam"):
    page = (_site() / "api" / "generated" / f"onebit_optax.{name}.html").read_text()
    signature = re.sub(r"<[^>]+>", "", page.split('<dl class="py function">', 1)[1])
    signature = signature.split(")", 1)[0]
    assert "learning_rate: optax.ScalarOrSchedule" in signature, (name, signature)
    assert "complex" not in signature and "TypeAliasForwardRef" not in signature, signature


# ----------------------------------------------------------------------------
# Without a build.


@pytest.mark.parametrize("code, targets", [
    ("onebit_adam", ["onebit_optax.onebit_adam"]),
    ("onebit_adam(learning_rate=1e-3, freeze_step=100)", ["onebit_optax.onebit_adam"]),
    ("onebit_optax.status(state).frozen", ["onebit_optax.status"]),
    ("state.moments", []),
    ("'status'", []),
    ("optax.chain(onebit_optax.mean_updates('data'), optax.adam(lr))",
     ["optax.chain", "onebit_optax.mean_updates", "optax.adam"]),
    ("nnx.Optimizer", ["flax.nnx.Optimizer"]),
    ("jnp.where", ["jax.numpy.where"]),
    ("optax.not_a_name", []),
])
def test_code_links_find_api_names(code, targets):
  public, external = frozenset(onebit_optax.__all__), onebit_docs._external_names()  # pylint: disable=protected-access
  assert [t for _, _, t in onebit_docs.code_links(code, public, external)] == targets


def test_shipped_inventories_are_the_generated_ones():
  # Edit docs/_inventories/make_inventories.py's TABLE, then run it: the .inv files follow.
  for library in make_inventories.TABLE:
    shipped = ROOT / "docs" / "_inventories" / f"{library}.inv"
    assert shipped.read_bytes() == make_inventories.inventory(library), (
        f"{shipped.name} is stale: run python docs/_inventories/make_inventories.py")


def test_every_internal_link_and_anchor_resolves():
  # The site's own links: every href to a page of the site names a file that was built and,
  # with a #fragment, an id on that page (Sphinx's -n checks references, not raw links).
  site = _site()
  ids: dict[Path, set[str]] = {}

  def ids_of(page: Path) -> set[str]:
    if page not in ids:
      ids[page] = set(re.findall(r'\bid="([^"]+)"', page.read_text()))
    return ids[page]

  # The pages this build wrote (an earlier build's pages of removed names stay on disk).
  index = (site / "searchindex.js").read_text()
  docnames = re.findall(r'"([^"]+)"', re.search(r'"docnames":\[(.*?)\]', index).group(1))
  broken, checked = [], 0
  for page in (site / f"{name}.html" for name in docnames):
    for href in re.findall(r'<a\b[^>]*\bhref="([^"]+)"', _without_scripts(page.read_text())):
      if re.match(r"[a-z][a-z0-9+.-]*:", href) or href.startswith("//"):
        continue  # another site, mailto:
      path, _, fragment = href.partition("#")
      target = (page.parent / path.split("?")[0]).resolve() if path else page
      checked += 1
      if not target.exists():
        broken.append(f"{page.relative_to(site)} -> {href}")
      elif fragment and target.suffix == ".html" and fragment not in ids_of(target):
        broken.append(f"{page.relative_to(site)} -> {href} (no such anchor)")
  assert checked > 1000, checked
  assert not broken, broken[:20]

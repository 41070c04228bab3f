"""Math rendered at build time: LaTeX to MathML Core, which browsers draw without a script.

The pages carry ``<math>`` elements, not ``\\(...\\)`` for a script to typeset, so the
math reads offline and without JavaScript. The converter is the ``math-core``
package (pinned in the ``docs`` extra). LaTeX it cannot convert is a build
warning (so an error: the build runs with ``-W``) naming the page and the source.
"""

from __future__ import annotations

from docutils import nodes
from sphinx.locale import _
from sphinx.util import logging
from sphinx.util.math import get_node_equation_number

import math_core

logger = logging.getLogger(__name__)
_CONVERTER = math_core.LatexToMathML()


def to_mathml(latex: str, display: bool) -> str | None:
  """The MathML of ``latex``, or None (after a warning) where it does not convert."""
  try:
    return _CONVERTER.convert_with_local_state(latex, displaystyle=display)
  except math_core.LatexError as e:
    logger.warning("math that does not convert to MathML: %r: %s", latex, e,
                   type="onebit", subtype="math")
    return None


def _visit_inline(self, node: nodes.math) -> None:
  mathml = to_mathml(node.astext(), display=False)
  self.body.append(self.starttag(node, "span", "", CLASS="math notranslate"))
  self.body.append((mathml or self.encode(node.astext())) + "</span>")
  raise nodes.SkipNode


def _block_latex(text: str) -> str:
  """Several equations (blank-line separated) or ``\\\\`` line breaks become one aligned block."""
  parts = [part for part in text.split("\n\n") if part.strip()]
  if len(parts) == 1 and r"\\" not in parts[0]:
    return parts[0]
  return r"\begin{aligned}" + r"\\".join(parts) + r"\end{aligned}"


def _visit_block(self, node: nodes.math_block) -> None:
  self.body.append(self.starttag(node, "div", CLASS="math notranslate"))
  if node["number"]:
    number = get_node_equation_number(self, node)
    self.body.append(f'<span class="eqno">({number})')
    self.add_permalink_ref(node, _("Link to this equation"))
    self.body.append("</span>")
  mathml = to_mathml(_block_latex(node.astext()), display=True)
  self.body.append((mathml or self.encode(node.astext())) + "</div>\n")
  raise nodes.SkipNode


def setup(app):
  app.add_html_math_renderer("mathml", inline_renderers=(_visit_inline, None),
                             block_renderers=(_visit_block, None))
  return {"parallel_read_safe": True, "parallel_write_safe": True}

// A small markdown renderer for the chat page: model text -> DOM nodes.
//
// Safe by construction: text only ever reaches the page through createTextNode / textContent,
// never through innerHTML, so model output cannot inject markup or scripts. Links keep only
// http(s) and mailto targets. Covered: fenced code blocks (``` with an optional language; an
// unclosed fence, as while streaming, runs to the end), headings, bullet and numbered lists,
// block quotes, paragraphs (single line breaks kept), and inline `code`, **bold**, *italic*,
// [text](url).
"use strict";

(function (global) {
  const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;
  // inline: `code` | **bold** | *italic* / _italic_ | [text](url)
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\b_([^_]+)_\b|\[([^\]]+)\]\(([^)\s]+)\)/g;
  const SAFE_LINK = ["http:", "https:", "mailto:"];

  function element(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function safeHref(url) {
    try {
      const parsed = new URL(url, global.location.href);
      return SAFE_LINK.includes(parsed.protocol) ? parsed.href : null;
    } catch (_) {
      return null;
    }
  }

  // Append the inline markup of `text` to `parent`.
  function renderInline(text, parent) {
    let last = 0;
    // NOTE: matchAll scans with its own copy of the pattern, so the recursive calls below
    // (bold, italic, link text) cannot move this scan's position.
    for (const match of text.matchAll(INLINE)) {
      if (match.index > last) parent.appendChild(document.createTextNode(text.slice(last, match.index)));
      last = match.index + match[0].length;
      if (match[2] !== undefined) {
        const code = element("code");
        code.textContent = match[2];
        parent.appendChild(code);
      } else if (match[3] !== undefined) {
        renderInline(match[3], parent.appendChild(element("strong")));
      } else if (match[4] !== undefined || match[5] !== undefined) {
        renderInline(match[4] !== undefined ? match[4] : match[5], parent.appendChild(element("em")));
      } else {
        const href = safeHref(match[7]);
        if (href === null) {
          parent.appendChild(document.createTextNode(match[0]));
          continue;
        }
        const link = element("a");
        link.href = href;
        link.rel = "noopener noreferrer";
        link.target = "_blank";
        renderInline(match[6], link);
        parent.appendChild(link);
      }
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  // Append `lines` (a paragraph) to `parent`, line breaks kept.
  function renderLines(lines, parent) {
    lines.forEach((line, i) => {
      if (i > 0) parent.appendChild(element("br"));
      renderInline(line, parent);
    });
  }

  // Replace the children of `container` with the rendering of `text`.
  function render(text, container) {
    container.replaceChildren();
    const lines = text.split("\n");
    let paragraph = [];
    let list = null;
    const flush = () => {
      if (paragraph.length) renderLines(paragraph, container.appendChild(element("p")));
      paragraph = [];
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = FENCE.exec(line);
      if (fence) {
        flush();
        const body = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
        const pre = container.appendChild(element("pre"));
        if (fence[1]) pre.dataset.lang = fence[1];
        const code = pre.appendChild(element("code"));
        code.textContent = body.join("\n");
        continue;
      }
      let match;
      if (!line.trim()) {
        flush();
      } else if ((match = HEADING.exec(line))) {
        flush();
        renderInline(match[2], container.appendChild(element("h" + match[1].length)));
      } else if ((match = BULLET.exec(line)) || (match = NUMBERED.exec(line))) {
        const tag = BULLET.test(line) ? "UL" : "OL";
        if (paragraph.length) flush();
        if (!list || list.tagName !== tag) list = container.appendChild(element(tag.toLowerCase()));
        renderInline(match[1], list.appendChild(element("li")));
      } else if ((match = QUOTE.exec(line))) {
        flush();
        renderInline(match[1], container.appendChild(element("blockquote")));
      } else {
        if (list) list = null;
        paragraph.push(line);
      }
    }
    flush();
  }

  global.PagedMarkdown = { render: render };
})(window);

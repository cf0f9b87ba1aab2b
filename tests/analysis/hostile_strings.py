"""Strings for the viewer tests (browser and not)."""

# Strings that break out of a context when they are not escaped for it: HTML text, a
# placeholder of the page, JSON inside <script>, the HTML comment / script-data states, CDATA,
# template literals, line separators that end a JavaScript string, bidi overrides, NUL.
HOSTILE = [
    "__DATA__<img src=x onerror=alert(1)>",
    "__TITLE__</title><script>alert(2)</script>",
    "<!--<script>",
    "</script><script>alert(3)</script>",
    "]]>${alert(4)}`",
    "\"'><svg onload=alert(5)>",
    "a\u2028b\u2029c",
    "\u202eevil\u202c",
    "x\x00y",
    "e\u0301\u0327 👩‍👩‍👧 שלום",
]

// Render the \( \) and \[ \] spans that pymdownx.arithmatex leaves, after every page load
// (Material's instant navigation swaps pages without a reload, hence document$).
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
  });
});

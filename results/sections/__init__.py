"""One module per section of docs/results.md: `render(summary) -> str` (see the package doc)."""

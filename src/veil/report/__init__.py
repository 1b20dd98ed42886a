"""Reports: the audit summary (stable keys), Markdown and self-contained HTML, figures."""

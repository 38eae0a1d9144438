"""Reports: terminal tables (and, later, HTML, A/B and scaling reports) rendered from RunSummary."""

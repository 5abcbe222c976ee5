"""Stage 6, comparison: fxplan against its peers, measured side by side, and the reports."""

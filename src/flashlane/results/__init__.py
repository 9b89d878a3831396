"""Results store: every bench, compare and tune run, its manifest and summary, in SQLite, so
`flashlane history` can show trends and flag regressions. Torch-free; imports nothing else of
flashlane."""

"""The study's vocabulary, the bottom floor: what a study is (specs, the catalogue of
encodings, tasks, scalings and models), what its numbers mean (metrics, statuses, the
results schema, analysis), and the rules every floor above shares (settings, files,
errors, text shown safely). Nothing of ours below it; no torch or database at import."""

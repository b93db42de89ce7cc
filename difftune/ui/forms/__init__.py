"""Run forms: fields from the config models, what applies, presets, TOML in and out."""

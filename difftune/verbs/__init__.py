"""What each CLI verb does, as plain functions the CLI (and later the UI) calls: `train`,
`check`, `cache`, `sample` (without training), `demo`, `launch` (many processes); `common`
holds what several share."""

"""`python -m difftune` runs the same CLI as the `difftune` console script."""

from difftune.cli import main

raise SystemExit(main())

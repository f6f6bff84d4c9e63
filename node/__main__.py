"""`python -m node` is the `litegraph-node` command."""

from node.cli import main

raise SystemExit(main())

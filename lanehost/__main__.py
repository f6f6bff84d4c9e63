"""`python -m lanehost --lane-id ID --memory-bytes N [--backend auto|numpy|cupy]`."""

from lanehost.host import main

raise SystemExit(main())

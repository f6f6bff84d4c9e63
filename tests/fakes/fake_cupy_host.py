"""`python tests/fakes/fake_cupy_host.py ARGS`: the real lane host (`python -m lanehost
ARGS`) with `tests.fakes.fake_cupy.FakeCupy` imported as `cupy`, set up from the
FAKE_CUPY_* variables of its environment. The owner's client starts it like any
host command, so the whole CUDA path - backend selection, the self-test, the
measured context, the pool's limit, sticky errors - runs in a real process
without a GPU."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tests.fakes.fake_cupy import FakeCupy

sys.modules["cupy"] = FakeCupy.from_environment()  # type: ignore[assignment]

from lanehost.host import main  # noqa: E402

raise SystemExit(main())

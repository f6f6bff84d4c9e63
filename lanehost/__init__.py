"""The built-in lane host: one trusted process per lane that owns its device state.

`python -m lanehost --lane-id ID --memory-bytes N` speaks the protocol of
`lanehost.protocol` with its lane owner over stdin and stdout, and nothing
else: it never sees a token and never talks to a guest. See
docs/lane-host-protocol.md.
"""

from lanehost.kernels import Kernel, KernelError, load_kernels
from lanehost.protocol import MAX_DATA_BYTES, MAX_FRAME_BYTES, PROTOCOL_VERSION

__all__ = [
    "MAX_DATA_BYTES",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Kernel",
    "KernelError",
    "load_kernels",
]

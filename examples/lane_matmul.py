"""Lane work with a capability token alone: the program a sandbox guest or a pod with a
lanes.litegraph.dev claim runs to multiply two matrices on its lane.

It needs only the Python standard library and what the node gives it:
LITEGRAPH_NODE_SOCKET (the node's Unix socket), LITEGRAPH_LANE_IDS (its lanes) and
LITEGRAPH_CAPABILITY_TOKEN_FILE (one token per line, in the lanes' order; read again
when the node refuses a token that the file no longer holds). It reserves
three buffers on its first lane, uploads A (3x4) and B (4x5), runs the node's `matmul`
kernel, downloads the product and prints one JSON line: the product's float32 bytes in
base64, and the /dev/nvidia* nodes it can see (none: the lane host does the GPU work).
"""

import base64
import http.client
import json
import os
import socket
import struct

M, K, N = 3, 4, 5


class Node(http.client.HTTPConnection):
    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect(os.environ["LITEGRAPH_NODE_SOCKET"])


LANE = os.environ["LITEGRAPH_LANE_IDS"].split(",")[0]


def token() -> str:
    """The lane's token, read afresh: a claim's node writes a new one at half its life."""
    with open(os.environ["LITEGRAPH_CAPABILITY_TOKEN_FILE"]) as token_file:
        return token_file.read().split()[0]


TOKEN = [token()]


def call(method: str, path: str, body: bytes = b"", kind: str = "application/json") -> bytes:
    for _ in range(2):
        node = Node("node", timeout=30)
        headers = {"Authorization": "Bearer " + TOKEN[0], "Content-Type": kind}
        node.request(method, f"/v1/lanes/{LANE}" + path, body, headers)
        reply = node.getresponse()
        data = reply.read()
        if reply.status == 401 and token() != TOKEN[0]:
            TOKEN[0] = token()  # superseded by a fresh one: once more with it
            continue
        break
    if reply.status != 200:
        raise SystemExit(f"{method} {path}: {reply.status} {data.decode(errors='replace')}")
    return data


def work(**body: object) -> dict[str, str]:
    answer: dict[str, str] = json.loads(call("POST", "/work", json.dumps(body).encode()))
    return answer


def matrix(rows: int, cols: int, scale: float) -> bytes:
    return struct.pack(f"<{rows * cols}f", *((i - 3) / scale for i in range(rows * cols)))


a, b, out = (
    work(op="memory_reserve", dtype="float32", shape=shape)["buffer_id"]
    for shape in ([M, K], [K, N], [M, N])
)
octets = "application/octet-stream"
call("PUT", f"/buffers/{a}?offset=0", matrix(M, K, 7), octets)
call("PUT", f"/buffers/{b}?offset=0", matrix(K, N, 3), octets)
work(op="execute", kernel="matmul", buffers={"a": a, "b": b, "out": out})
product = call("GET", f"/buffers/{out}?offset=0&length={M * N * 4}")
devices = sorted(name for name in os.listdir("/dev") if name.startswith("nvidia"))
print(json.dumps({"product": base64.b64encode(product).decode(), "devices": devices}))

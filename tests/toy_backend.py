"""A KV backend from outside the package, in one file, as a user adds one (README.md,
"Adding a KV backend or a routing policy"): tests/test_plugins.py names this file in
$SPLITSERVE_KV_BACKENDS.

The toy backend is tcp's framing under a name and an address scheme of its own
(``toy://host:port``: a tcp sender refuses such an address, so blocks that reach a toy
receiver came through a toy sender), in small frames (64 KiB: more frames per transfer
than tcp's 2 MiB), and with abilities of its own: it serves no pulls (a prefill node
receives pulled prefixes over the default backend, tcp, instead).
"""

from splitserve.common.kv_backends import KVBackendSpec
from splitserve.kvtransfer.backends.tcp import TcpReceiver, TcpSender

NAME = "toy"


class ToySender(TcpSender):
    scheme = NAME
    default_frame_bytes = 64 << 10


class ToyReceiver(TcpReceiver):
    scheme = NAME


BACKEND = KVBackendSpec(NAME, sender=ToySender, receiver=ToyReceiver, serves_pulls=False)

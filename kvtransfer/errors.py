"""The errors of KV block transport.

Owns: ``TransferError``, the one exception a sender raises for any failure
(connection refused or lost, handshake refused, timeout, blocks rejected by the
receiver). Must not: carry anything but a message; callers react to the type
(fall back to local prefill), the message is for logs and the debug endpoint.
"""


class TransferError(RuntimeError):
    """A KV transfer (or the connection it needs) failed; the message says why and with whom."""

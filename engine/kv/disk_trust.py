"""What the disk tier trusts: folders private to the node's user, and the node's MAC key.

Owns the checks and the making of the tier's folders (``private_dir``) and the resolution
of the key its block files are authenticated with (``disk_key``). Must not read or write
block files (engine/kv/disk_tier.py does) or know about the engine.

The key (HMAC-SHA256, engine/kv/disk_tier.py) is, in this order::

    $SPLITSERVE_KV_DISK_KEY        hex, at least 32 digits (16 bytes): e.g. `openssl rand -hex 32`
    $SPLITSERVE_KV_DISK_KEY_FILE   a file holding that hex, readable by the node's user only
    <kv_offload_dir>/kv-disk.key   otherwise: made once (32 random bytes, 0600) and reused,
                                   so a restarted node reads its own files again

A file written under another key (another node's, a planted one, a key that changed) is a
miss and a counted fault: nodes meant to share a folder's files must share the key. A
secret given in the environment stays out of ``ps``; the key file is refused, with what to
do, when it is not a regular file of this user that only this user may read.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

KEY_ENV = "SPLITSERVE_KV_DISK_KEY"
KEY_FILE_ENV = "SPLITSERVE_KV_DISK_KEY_FILE"
KEY_FILE_NAME = "kv-disk.key"  # in the tier's root folder, when neither variable is set
KEY_BYTES = 32  # of a key the tier makes
MIN_KEY_BYTES = 16  # of a key given: a shorter one is a typo or a placeholder
_PRIVATE = stat.S_IRWXG | stat.S_IRWXO  # mode bits no one but the owner may have


def private_dir(path: Path, follow: bool = True) -> None:
    """Make the folder ``path`` (and its missing parents) mode 0700, or check that an
    existing one is a folder of this user that no other user may access. ``follow=False``:
    ``path`` itself must not be a symlink (a folder the tier names, not the user). Raises
    ValueError naming the folder and what to do."""
    missing = []
    at = path
    while not os.path.lexists(at) and at != at.parent:
        missing.append(at)
        at = at.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # another process made it meanwhile: checked below
            pass
        except OSError as e:
            raise ValueError(f"kv_offload_dir: cannot create {folder}: {e.strerror}") from None
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        raise ValueError(f"kv_offload_dir: cannot use {path}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"kv_offload_dir: {path} is not a folder{'' if follow else ' (a symlink?)'}; "
                         "remove it or give the node another folder")
    if st.st_uid != os.geteuid():
        raise ValueError(f"kv_offload_dir: {path} belongs to uid {st.st_uid}, not to this node's user "
                         f"(uid {os.geteuid()}); give the node a folder of its own")
    if st.st_mode & _PRIVATE:
        raise ValueError(f"kv_offload_dir: other users may access {path} (mode {stat.S_IMODE(st.st_mode):o}); "
                         f"run `chmod 700 {path}` or give the node a folder of its own")


def disk_key(root: Path, env: Mapping[str, str] = os.environ) -> bytes:
    """The disk tier's MAC key (see the module docstring); ``root`` must be private already
    (``private_dir``). Raises ValueError naming the variable or file and what to do."""
    given = env.get(KEY_ENV)
    if given:
        return _parse(given, f"${KEY_ENV}")
    file = env.get(KEY_FILE_ENV)
    if file:
        return _read_key_file(Path(file), f"${KEY_FILE_ENV} ({file})")
    path = root / KEY_FILE_NAME
    if not os.path.lexists(path):
        try:
            _make_key_file(path)
        except OSError as e:
            raise ValueError(f"kv_offload_dir: cannot write the disk tier's key file {path}: {e.strerror}; "
                             f"make the folder writable or set ${KEY_ENV}") from None
    return _read_key_file(path, f"the disk tier's key file {path}")


def _parse(text: str, what: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{what}: a disk tier key is hex of at least {2 * MIN_KEY_BYTES} digits; "
                         "make one with `openssl rand -hex 32`")
    return key


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "it is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise ValueError(f"{what}: cannot read it: {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & _PRIVATE:
            raise ValueError(f"{what}: must be a regular file of this node's user (uid {os.geteuid()}) that only "
                             f"it may read (mode 600); it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}")
        text = f.read(4096).decode("ascii", errors="replace")
    return _parse(text, f"{what} (delete it for a new key: the files written under the old one become misses)")


def _make_key_file(path: Path) -> None:
    """Write a fresh key to ``path`` whole, or leave the one another process made first:
    written to a temporary of an unpredictable name, then linked (which fails if ``path``
    exists)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_bytes(KEY_BYTES).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)

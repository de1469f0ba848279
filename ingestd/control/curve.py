"""CURVE keys for the control plane: key files, and the ZAP authenticator.

Key files use ZeroMQ's certificate format (what ``zmq.auth.load_certificate``
reads): ``NAME.key`` holds the public key, ``NAME.key_secret`` the public and
secret key. Secret files are created with mode 0600 from the start (never
written first and chmod-ed later). The daemon authorises a client when the
client's ``NAME.key`` sits in ``control.curve_authorized_keys``.
"""
from __future__ import annotations

import datetime
import errno
import logging
import os
import re
import stat
from pathlib import Path

import zmq

log = logging.getLogger("ingestd.control")

_Z85_KEY = re.compile(rb"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")

_BANNER = """#   ****  Generated on {now} by ingestctl keygen  ****
#   ZeroMQ CURVE {kind} Certificate
#   {advice}

metadata
curve
    public-key = "{public}"
"""


class KeyFileError(ValueError):
    """A CURVE key file is missing, unreadable, or not a ZeroMQ certificate."""


def keygen(directory: str | os.PathLike, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600) in ``directory``; return both paths.

    ``directory`` must exist (``FileNotFoundError``, ``NotADirectoryError``): creating it would
    turn a typo into keys written where nobody looks for them."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("."):
        raise ValueError(f"key name {name!r} must be letters, digits, '_', '-' or '.' (a file name)")
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(errno.ENOENT, "no such directory (create it first)", str(directory))
    if not directory.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory))
    public, secret = zmq.curve_keypair()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    secret_text = _BANNER.format(now=now, kind="**Secret**", public=public.decode(),
                                 advice="DO NOT share this file or loosen its permissions (0600).")
    secret_text += f'    secret-key = "{secret.decode()}"\n'
    public_text = _BANNER.format(now=now, kind="Public", public=public.decode(),
                                 advice="Copy this file into the daemon's control.curve_authorized_keys directory.")
    _write(secret_path, secret_text, 0o600, force)
    _write(public_path, public_text, 0o644, force)
    return public_path, secret_path


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    """A new file, made with ``mode`` from the start, never through a link someone planted: with
    ``force``, written beside the target and renamed over it (replacing a link, not its target)."""
    target = path
    if force:
        path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT honours the umask: set the mode itself
        os.write(fd, text.encode())
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    if force:
        os.replace(path, target)


_MAX_KEY_FILE = 4096  # a certificate is a few hundred bytes


def _read_keys(path: Path) -> tuple[bytes | None, bytes | None]:
    """The keys of a certificate file: a regular file (a FIFO dropped in the keys dir blocked the
    daemon's main loop on reload) of at most a few KiB. Links are followed: secret mounts and
    config management deliver keys as links, and reading through one gives nobody anything."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise KeyFileError(f"cannot read CURVE key file {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise KeyFileError(f"CURVE key file {path} is not a regular file")
        text = os.read(fd, _MAX_KEY_FILE + 1)
    except OSError as exc:
        raise KeyFileError(f"cannot read CURVE key file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(text) > _MAX_KEY_FILE:
        raise KeyFileError(f"CURVE key file {path} is larger than {_MAX_KEY_FILE} bytes; it is not a certificate")
    found: dict[bytes, bytes] = {}
    for line in text.splitlines():
        line = line.strip()
        for field in (b"public-key", b"secret-key"):
            if line.startswith(field) and b"=" in line:
                found[field] = line.split(b"=", 1)[1].strip(b" \t'\"")
    keys = []
    for field in (b"public-key", b"secret-key"):
        value = found.get(field)
        if value is not None and not _Z85_KEY.fullmatch(value):
            raise KeyFileError(f"{path}: {field.decode()} is not a 40-character Z85 key")
        keys.append(value)
    return keys[0], keys[1]


def load_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)`` from a ``.key_secret`` file; warns if others can read it."""
    path = Path(path)
    public, secret = _read_keys(path)
    if public is None or secret is None:
        raise KeyFileError(f"{path} holds no secret key; use the NAME.key_secret file that "
                           "`ingestctl keygen NAME [--dir D]` writes")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("CURVE secret key %s has mode %04o; other users may read it: chmod 600 it", path, mode)
    return public, secret


def load_public(spec: str | bytes | os.PathLike) -> bytes:
    """A public key given as its 40-character Z85 text or as a key file (``.key`` or ``.key_secret``)."""
    raw = spec.encode() if isinstance(spec, str) else spec
    if isinstance(raw, bytes) and _Z85_KEY.fullmatch(raw) and not Path(os.fsdecode(raw)).exists():
        return raw
    public, _ = _read_keys(Path(os.fsdecode(spec)))
    if public is None:
        raise KeyFileError(f"{spec}: no public-key line; is it a ZeroMQ CURVE certificate?")
    return public


def make_server(sock: zmq.Socket, public: bytes, secret: bytes) -> None:
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True


def make_client(sock: zmq.Socket, server_public: bytes, client_secret_file: str | os.PathLike) -> None:
    public, secret = load_secret(client_secret_file)
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = public, secret


class Authenticator:
    """The ZAP handler of one context: lets in the clients whose public keys are in ``directory``."""

    def __init__(self, context: zmq.Context, directory: str | os.PathLike):
        from zmq.auth.thread import ThreadAuthenticator

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise KeyFileError(f"control.curve_authorized_keys {self.directory} is not a directory")
        self._keys: frozenset[bytes] = frozenset()
        self._refused_logged: set[str | None] = set()
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("ingestd.control.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)
        self.reload()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by the ZAP thread for each CURVE handshake (``client_key`` in Z85)."""
        allowed = client_key in self._keys
        if not allowed:
            log.warning("CURVE: refused a client with unknown public key %s", client_key.decode(errors="replace"))
        return allowed

    def allows(self, user_id: str | None) -> bool:
        """Whether a request from a connection the ZAP handler let in (``user_id``: the client's
        key, Z85) is still authorised: a key removed since, and reloaded, no longer is."""
        return user_id is not None and user_id.encode() in self._keys

    def refused_request(self, user_id: str | None) -> None:
        if user_id not in self._refused_logged:  # once per key: a revoked client may keep sending
            self._refused_logged.add(user_id)
            log.warning("CURVE: dropped a request from revoked key %s (its connection predates the revocation)",
                        user_id)

    def reload(self) -> int:
        """(Re-)read the authorised keys (at start and on every reload); returns how many."""
        keys = set()
        for path in sorted(self.directory.glob("*.key")):
            try:
                public, _ = _read_keys(path)
            except KeyFileError as exc:
                log.warning("CURVE: skipping %s", exc)
                continue
            if public is not None:
                keys.add(public)
        self._keys = frozenset(keys)  # one assignment: the ZAP thread sees the old or the new set
        log.info("CURVE: %d authorised client key(s) in %s", len(keys), self.directory)
        return len(keys)

    def stop(self) -> None:
        self._auth.stop()

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
import threading
import time
from pathlib import Path
from typing import Callable

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
    """The keys of a certificate file (see :func:`_read_key_file`)."""
    return _parse_keys(path, _read_key_file(path))


def _read_key_file(path: Path) -> bytes:
    """A key file's text: a regular file (a FIFO dropped in the keys dir blocked the daemon's
    main loop on reload) of at most a few KiB. Links are followed: secret mounts and config
    management deliver keys as links, and reading through one gives nobody anything."""
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
    return text


def _parse_keys(path: Path, text: bytes) -> tuple[bytes | None, bytes | None]:
    """``(public, secret)`` of a ZeroMQ certificate's text; None for a key it does not hold."""
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
    """``(public, secret)`` from a ``.key_secret`` file; warns if users outside its group can
    read it (``root:ingestd`` 0640 is the way to let the service user read a root-owned key)."""
    path = Path(path)
    public, secret = _read_keys(path)
    if public is None or secret is None:
        raise KeyFileError(f"{path} holds no secret key; use the NAME.key_secret file that "
                           "`ingestctl keygen NAME [--dir D]` writes")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o007:
        log.warning("CURVE secret key %s has mode %04o; every user may read it: chmod o-rwx it", path, mode)
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


def make_client(sock: zmq.Socket, server_public: bytes, public: bytes, secret: bytes) -> None:
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = public, secret


class Authenticator:
    """The ZAP handler of one context: lets in the clients whose public keys are in ``directory``.

    ``on_refuse(reason)`` is called for every refusal (``unknown_key``: a handshake; ``revoked``:
    a request on a connection whose key was removed since), for the metrics. The log is
    throttled: anyone can offer fresh random keys, and one line per handshake would flood the
    journal (journald then drops the daemon's own messages)."""

    LOG_EVERY_S = 10.0  # at most one "refused" line per kind this often; the others are counted

    def __init__(self, context: zmq.Context, directory: str | os.PathLike,
                 on_refuse: Callable[[str], None] = lambda reason: None):
        from zmq.auth.thread import ThreadAuthenticator

        self.directory = Path(directory)
        self._on_refuse = on_refuse
        self._keys: frozenset[bytes] = frozenset(authorized_keys(self.directory))  # KeyFileError: start-up refuses
        self._revoked_logged: set[str] = set()
        self._quiet = {"unknown_key": _Throttle(self.LOG_EVERY_S), "revoked": _Throttle(self.LOG_EVERY_S)}
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("ingestd.control.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)
        self._announce()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by the ZAP thread for each CURVE handshake (``client_key`` in Z85)."""
        if client_key in self._keys:
            return True
        self._on_refuse("unknown_key")
        if (skipped := self._quiet["unknown_key"].allow()) is not None:
            log.warning("CURVE: refused a client with unknown public key %s%s",
                        client_key.decode(errors="replace"), _more(skipped, "refused handshakes"))
        return False

    def allows(self, user_id: str | None) -> bool:
        """Whether a request is authorised: it came through a local ipc listener, which has no
        CURVE (``user_id`` None), or its connection's key (``user_id``: the key the ZAP handler
        let in, Z85) is still in the directory: a key removed since, and reloaded, is not."""
        return user_id is None or user_id.encode() in self._keys

    def refused_request(self, user_id: str) -> None:
        self._on_refuse("revoked")
        if user_id in self._revoked_logged:  # once per key and revocation: a revoked client may keep sending
            return
        if (skipped := self._quiet["revoked"].allow()) is not None:
            self._revoked_logged.add(user_id)
            log.warning("CURVE: dropped a request from revoked key %s (its connection predates the "
                        "revocation)%s", user_id, _more(skipped, "dropped requests"))

    def reload(self) -> int:
        """Re-read the authorised keys (every reload); returns how many. ``KeyFileError`` if the
        directory cannot be read: the old set stays (an unreadable directory is not "no keys",
        which would lock every operator out)."""
        self._keys = frozenset(authorized_keys(self.directory))  # one assignment: the ZAP thread sees the old or the new set
        self._revoked_logged.clear()
        return self._announce()

    @property
    def count(self) -> int:
        return len(self._keys)

    def _announce(self) -> int:
        n = len(self._keys)
        if n == 0:
            log.warning("CURVE: no authorised client key in %s: no tcp client can connect; put clients' "
                        "NAME.key files there and reload", self.directory)
        else:
            log.info("CURVE: %d authorised client key(s) in %s", n, self.directory)
        return n

    def stop(self) -> None:
        self._auth.stop()


def authorized_keys(directory: str | os.PathLike) -> set[bytes]:
    """The public keys of the ``*.key`` files in ``directory`` (a file may also hold just the
    40-character key); files that hold none are skipped with a warning. ``KeyFileError`` if the
    directory cannot be read."""
    directory = Path(directory)
    try:
        with os.scandir(directory) as entries:
            names = sorted(e.name for e in entries if e.name.endswith(".key"))
    except OSError as exc:
        raise KeyFileError(f"cannot read the authorised-keys directory {directory}: {exc.strerror}") from None
    keys = set()
    for name in names:
        try:
            keys.add(_public_of(directory / name))
        except KeyFileError as exc:
            log.warning("CURVE: skipping %s", exc)
    return keys


def check_files(secret_key: str | os.PathLike, authorized: str | os.PathLike) -> None:
    """What the daemon reads at start (``ingestd config check`` and ``ingestd run`` check it
    before anything else): ``ConfigError`` naming the key whose file is missing or unusable."""
    from ingestd.errors import ConfigError

    try:
        load_secret(secret_key)
    except KeyFileError as exc:
        raise ConfigError("control.curve_secret_key", str(exc)) from None
    try:
        authorized_keys(authorized)
    except KeyFileError as exc:
        raise ConfigError("control.curve_authorized_keys", str(exc)) from None


def _public_of(path: Path) -> bytes:
    """The public key of an authorised-keys file: a certificate, or only the 40-character key
    (comments and blank lines aside)."""
    text = _read_key_file(path)
    public, secret = _parse_keys(path, text)
    if secret is not None:
        log.warning("CURVE: %s holds a secret key; only public keys belong in the authorised-keys "
                    "directory: move the secret file elsewhere and copy NAME.key here", path)
    if public is not None:
        return public
    lines = [line for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith(b"#")]
    if len(lines) == 1 and _Z85_KEY.fullmatch(lines[0]):
        return lines[0]
    raise KeyFileError(f"{path} holds no public-key line (nor only a 40-character Z85 key); copy the "
                       "NAME.key file that `ingestctl keygen NAME` wrote")


class _Throttle:
    """``allow()``: None while a line was let through less than ``every_s`` ago (counting the
    skipped ones), else the number skipped since the last line let through."""

    def __init__(self, every_s: float):
        self.every_s, self._next, self._skipped = every_s, 0.0, 0
        self._lock = threading.Lock()

    def allow(self) -> int | None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._skipped += 1
                return None
            skipped, self._skipped, self._next = self._skipped, 0, now + self.every_s
            return skipped


def _more(skipped: int, what: str) -> str:
    return f" ({skipped} more {what} since the last such line, not logged)" if skipped else ""

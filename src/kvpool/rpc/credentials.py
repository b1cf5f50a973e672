"""Control-plane credentials: CURVE key pairs in small JSON files, and the master's auth directory.

Rules:
- A credential file holds one identity: its role (`node`, `tenant:<name>` or `admin`), its CURVE key
  pair and the master's public key, so a client or node needs exactly one path to connect. Secret
  material is written 0600 and never logged; a role's public key is its identity on the wire.
- The master's auth directory holds `master.key` (the server key pair) and `identities.json`
  (public key -> role, the only list the master trusts). `kvpool auth` edits it; the master reads it
  again whenever it changes, so adding or revoking an identity needs no restart.
- `init` is idempotent and race-safe (two masters starting at once end with one key pair): files
  are written to a temporary name and linked into place, never half-written.
- The default directory (`$KVPOOL_AUTH_DIR`, else `~/.config/kvpool/auth`) is where a master started
  without `--auth` or `--insecure` creates its keys and `admin.cred`, `node.cred` and
  `tenant-default.cred`. Clients and nodes use the credential they are given (argument,
  `$KVPOOL_CREDENTIAL`, `$KVPOOL_NODE_CREDENTIAL`). Given none, they connect without one; only a
  master on their own host that refuses them for want of CURVE makes them use the default
  directory's `tenant-default.cred` / `node.cred` (`local_default_credential`): a local start is
  two commands, and nothing is sent encrypted to a master elsewhere with a key found lying around.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvpool.core.errors import UsageError
# the variables' names are part of this module's interface (the node's service names its own)
from kvpool.rpc.config import ENV_AUTH_DIR, ENV_CREDENTIAL, ENV_NODE_CREDENTIAL, CredentialSettings  # noqa: F401


ROLE_NODE = "node"
ROLE_ADMIN = "admin"
TENANT_PREFIX = "tenant:"
MAX_NAME_LENGTH = 32
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,%d}$" % MAX_NAME_LENGTH)

MASTER_KEY_FILE = "master.key"
IDENTITIES_FILE = "identities.json"


def check_role(role: str) -> str:
    """`node`, `admin` or `tenant:<name>` (name: 1-32 of letters, digits, `_.-`); ValueError otherwise."""
    if role in (ROLE_NODE, ROLE_ADMIN):
        return role
    if role.startswith(TENANT_PREFIX) and _NAME.match(role[len(TENANT_PREFIX):]):
        return role
    raise ValueError(f"role must be 'node', 'admin' or 'tenant:NAME' (NAME: 1-{MAX_NAME_LENGTH} of A-Z a-z 0-9 _ . -), "
                     f"got {role!r}")


def credential_file_name(role: str) -> str:
    """node -> node.cred, tenant:alice -> tenant-alice.cred."""
    return check_role(role).replace(":", "-") + ".cred"


def default_auth_dir(settings: CredentialSettings | None = None) -> Path:
    """`settings.auth_dir` (None: CredentialSettings.from_env())."""
    return (CredentialSettings.from_env() if settings is None else settings).auth_dir


@dataclass(frozen=True)
class Credential:
    role: str
    public_key: str  # z85, 40 characters
    secret_key: str
    master_public_key: str

    def __repr__(self) -> str:  # never print the secret
        return f"Credential(role={self.role!r}, public_key={self.public_key!r})"

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Credential":
        """UsageError (a ValueError) naming the file when it is missing, unreadable or not a credential."""
        try:
            data = json.loads(Path(path).read_text())
            cred = cls(check_role(data["role"]), data["public_key"], data["secret_key"], data["master_public_key"])
        except FileNotFoundError:
            raise UsageError(f"credential file {path} does not exist (make one with `kvpool auth add`)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"credential file {path} is not a kvpool credential: {e}") from None
        for name in ("public_key", "secret_key", "master_public_key"):
            if len(getattr(cred, name)) != 40:
                raise UsageError(f"credential file {path}: {name} must be a 40-character z85 CURVE key")
        return cred

    def save(self, path: str | os.PathLike) -> Path:
        data = {"role": self.role, "public_key": self.public_key, "secret_key": self.secret_key,
                "master_public_key": self.master_public_key}
        return _write_private(Path(path), json.dumps(data, indent=1) + "\n")

    def apply_client(self, sock: zmq.Socket) -> None:
        """Make `sock` (before connect) a CURVE client of the master with this identity."""
        sock.curve_secretkey = self.secret_key.encode()
        sock.curve_publickey = self.public_key.encode()
        sock.curve_serverkey = self.master_public_key.encode()


def resolve_credential(explicit: str | os.PathLike | None, env_name: str = ENV_CREDENTIAL,
                       settings: CredentialSettings | None = None) -> Credential | None:
    """The credential to connect with: an explicit path, else the one variable `env_name` names
    (in `settings`; None: CredentialSettings.from_env()), else None (connect without CURVE).
    Nothing is picked up silently from the auth directory."""
    if not explicit:
        settings = CredentialSettings.from_env() if settings is None else settings
    path = explicit or settings.credential_path(env_name)
    return Credential.load(path) if path else None


def is_local_host(host: str) -> bool:
    """Whether `host` (a name or address) is this machine: it can be bound here."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def local_default_credential(host: str, role: str, settings: CredentialSettings | None = None) -> Credential | None:
    """The default auth directory's credential for `role` (`node`, `tenant:default`), when the
    master at `host` runs on this machine and the file is there; else None."""
    path = default_auth_dir(settings) / credential_file_name(role)
    if not path.is_file() or not is_local_host(host):
        return None
    try:
        return Credential.load(path)
    except ValueError:
        return None


def _write_private(path: Path, text: str) -> Path:
    """Write text to path, 0600, atomically (a reader sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


class AuthDir:
    """The master's auth directory: its key pair and the identities it trusts."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @property
    def identities_path(self) -> Path:
        return self.path / IDENTITIES_FILE

    def exists(self) -> bool:
        return (self.path / MASTER_KEY_FILE).exists()

    def init(self, roles: tuple[str, ...] = ()) -> list[Path]:
        """Create the master key pair if missing, then a credential for each role that has none;
        returns the credential files written now."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_path = self.path / MASTER_KEY_FILE
        if not key_path.exists():
            public, secret = zmq.curve_keypair()
            tmp = _write_private(self.path / f".master.{os.getpid()}.new",
                                 json.dumps({"public_key": public.decode(), "secret_key": secret.decode()}) + "\n")
            try:
                os.link(tmp, key_path)  # fails if another process won the race: keep theirs
            except FileExistsError:
                pass
            tmp.unlink()
        written = []
        for role in roles:
            if not (self.path / credential_file_name(role)).exists():
                written.append(self.add(role))
        return written

    def master_keys(self) -> tuple[str, str]:
        """(public, secret) z85; ValueError if the directory was never initialised."""
        try:
            data = json.loads((self.path / MASTER_KEY_FILE).read_text())
            return data["public_key"], data["secret_key"]
        except FileNotFoundError:
            raise ValueError(f"{self.path} has no {MASTER_KEY_FILE}: run `kvpool auth init {self.path}`") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path / MASTER_KEY_FILE} is damaged: {e}") from None

    def identities(self) -> dict[str, str]:
        """public key (z85) -> role."""
        try:
            data = json.loads(self.identities_path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as e:
            raise ValueError(f"{self.identities_path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{self.identities_path} must map public keys to roles")
        return {str(k): check_role(str(v)) for k, v in data.items()}

    def add(self, role: str, out: str | os.PathLike | None = None) -> Path:
        """A new identity for `role`: its key pair is trusted by the master and written, with the
        master's public key, to `out` (default: DIR/<role>.cred). Several identities may share a role."""
        check_role(role)
        master_public, _ = self.master_keys()
        public, secret = zmq.curve_keypair()
        cred = Credential(role, public.decode(), secret.decode(), master_public)
        path = cred.save(out if out is not None else self.path / credential_file_name(role))
        with self._locked():
            identities = self.identities()
            identities[cred.public_key] = role
            _write_private(self.identities_path, json.dumps(identities, indent=1, sort_keys=True) + "\n")
        return path

    def revoke(self, role_or_key: str) -> int:
        """Forget every identity with this role (or this public key); returns how many."""
        with self._locked():
            identities = self.identities()
            kept = {k: r for k, r in identities.items() if role_or_key not in (k, r)}
            _write_private(self.identities_path, json.dumps(kept, indent=1, sort_keys=True) + "\n")
        return len(identities) - len(kept)

    def _locked(self):
        """An exclusive lock on the directory's identity list (two `kvpool auth add` at once keep both)."""
        return _FileLock(self.path / ".lock")


class _FileLock:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # closing releases the lock

"""The master's authentication: CURVE on its ROUTER socket, a ZAP handler that admits known keys,
and the key -> Principal mapping the request loop consults for every message.

Rules:
- libzmq does the cryptography and the handshake; pyzmq's ThreadAuthenticator answers ZAP requests
  from its own thread. We only decide which keys are known (`identities.json` of the auth dir).
- A connection whose key is unknown never completes its handshake: no request of it reaches the
  loop, and the client sees the refusal (rpc/zmq_channel.py turns it into AuthError).
- The identity list is read again when its file changes (checked at most once a second by the
  loop, and at once when an unknown key knocks; the table is replaced whole, never edited, so readers need no lock). A key
  revoked while connected is refused at its next request (`principal_of` returns None).
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvpool.master.access import Principal
from kvpool.rpc.credentials import AuthDir

log = logging.getLogger("kvpool.master.auth")

ZAP_DOMAIN = "kvpool"
_RELOAD_EVERY_S = 1.0


class IdentityTable:
    """Public key (z85 text) -> Principal, from the auth directory, reloaded when it changes."""

    def __init__(self, auth_dir: AuthDir) -> None:
        self.auth_dir = auth_dir
        self._principals: dict[str, Principal] = {}
        self._mtime_ns = -1
        self._checked_s = 0.0
        self.refused_handshakes = 0
        self.reload()

    def reload(self) -> None:
        try:
            mtime_ns = self.auth_dir.identities_path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime_ns = 0
        if mtime_ns == self._mtime_ns:
            return
        try:
            identities = self.auth_dir.identities()
        except ValueError as e:  # keep serving with the last good list
            log.error("ignoring a damaged identity list: %s", e)
            return
        self._principals = {key: Principal.from_role(role, key) for key, role in identities.items()}
        self._mtime_ns = mtime_ns
        log.info("%d identities trusted (%s)", len(self._principals), self.auth_dir.identities_path)

    def maybe_reload(self) -> None:
        now_s = time.monotonic()
        if now_s - self._checked_s >= _RELOAD_EVERY_S:
            self._checked_s = now_s
            self.reload()

    def principal_of(self, key: str) -> Principal | None:
        return self._principals.get(key)

    # the ZAP handler's credentials provider
    def callback(self, domain: str, key: bytes) -> bool:
        text = key.decode("ascii", "replace")
        if text not in self._principals:
            self.reload()  # one stat: an identity added a moment ago is admitted at once
        known = text in self._principals
        if not known:
            self.refused_handshakes += 1
            log.warning("refused a connection with an unknown key %s", text)
        return known


class MasterAuth:
    """CURVE server settings for the master's socket plus the running ZAP handler."""

    def __init__(self, auth_dir: AuthDir, context: zmq.Context) -> None:
        self.public_key, self._secret_key = auth_dir.master_keys()
        self.identities = IdentityTable(auth_dir)
        self._authenticator = ThreadAuthenticator(context, log=logging.getLogger("kvpool.master.zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.identities)

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self._secret_key.encode()
        sock.curve_publickey = self.public_key.encode()
        sock.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        self._authenticator.stop()

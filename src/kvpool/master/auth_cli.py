"""`kvpool auth`: make and manage the master's CURVE keys and the identities it trusts.

    kvpool auth init DIR                 the master's key pair (+ admin.cred, node.cred)
    kvpool auth add DIR tenant:alice     a new identity; prints the credential file's path
    kvpool auth revoke DIR tenant:alice  every identity of that role (or one public key)
    kvpool auth list DIR                 public key -> role
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpool.rpc.credentials import ROLE_ADMIN, ROLE_NODE, AuthDir, default_auth_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Manage the master's authentication. A master started with --auth DIR accepts only connections "
        "whose CURVE key is listed in DIR/identities.json, and gives each the rights of its role: 'node' "
        "(mount and serve segments), 'tenant:NAME' (put and read objects in its own namespaces only) or "
        "'admin' (every namespace, and `kvpool status`). Each identity is one credential file (0600) to "
        "hand to a node (--credential), a client (credential= or $KVPOOL_CREDENTIAL) or `kvpool status`. "
        "The master re-reads the list within a second of a change: no restart to add or revoke."
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    default = str(default_auth_dir())
    init = sub.add_parser("init", help="create DIR with the master's key pair, admin.cred and node.cred")
    init.add_argument("dir", nargs="?", default=default, help=f"the auth directory (default: {default})")
    add = sub.add_parser("add", help="add an identity and write its credential file")
    add.add_argument("dir", help="the auth directory")
    add.add_argument("role", help="node, admin or tenant:NAME")
    add.add_argument("--out", type=Path, default=None, help="where to write the credential (default: DIR/ROLE.cred)")
    revoke = sub.add_parser("revoke", help="stop trusting every identity of a role, or one public key")
    revoke.add_argument("dir", help="the auth directory")
    revoke.add_argument("role_or_key", help="a role (tenant:alice) or a public key from `kvpool auth list`")
    listing = sub.add_parser("list", help="print the trusted identities")
    listing.add_argument("dir", help="the auth directory")


def run(args: argparse.Namespace) -> int:
    auth = AuthDir(args.dir)
    try:
        if args.action == "init":
            for path in auth.init((ROLE_ADMIN, ROLE_NODE)):
                print(f"wrote {path}")
            print(f"master public key {auth.master_keys()[0]}; start it with: kvpool master --auth {auth.path}")
        elif args.action == "add":
            print(auth.add(args.role, args.out))
        elif args.action == "revoke":
            count = auth.revoke(args.role_or_key)
            print(f"revoked {count} identities")
            return 0 if count else 1
        else:
            for key, role in sorted(auth.identities().items(), key=lambda kv: kv[1]):
                print(f"{role:<40} {key}")
    except (ValueError, OSError) as e:
        print(f"kvpool auth: {e}", file=sys.stderr)
        return 2
    return 0
